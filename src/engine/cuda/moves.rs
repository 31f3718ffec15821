//! How a move of a copy schedule (`algorithm::Move`, the host's reduce-to-one and hierarchical
//! copy) becomes work on a group's devices: copies between device buffers and reductions on one
//! device. Kept apart from the driver calls so that a test runs every schedule on a model of
//! device memory, on machines without a GPU too.

use crate::algorithm::Move;
use crate::error::Result;

/// Work queued on one device's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum DeviceOp {
    /// Device `to` copies the buffer at device `from`'s `src` to its own `dst`. `produced`: an
    /// earlier op of this call wrote the source, so the copy waits for `from`'s work so far.
    Copy {
        to: usize,
        dst: u64,
        from: usize,
        src: u64,
        produced: bool,
    },
    /// Device `at` computes `dst = (accumulate ? dst ⊕ : ) srcs[0] ⊕ srcs[1] ⊕ …` (sources as
    /// (device, address), in order), divided by `divisor` when set. `produced` as for `Copy`.
    Reduce {
        at: usize,
        dst: u64,
        srcs: Vec<(usize, u64)>,
        accumulate: bool,
        divisor: Option<usize>,
        produced: bool,
    },
}

/// The device work of move `m`, handed to `emit` in order: `send[d]` is device d's input,
/// `recv[d]` its output (the same address for a call in place); `mean`, the divisor that the
/// schedule's last reduction fuses in.
pub(super) fn lower(
    m: Move,
    send: &[u64],
    recv: &[u64],
    mean: Option<usize>,
    mut emit: impl FnMut(DeviceOp) -> Result<()>,
) -> Result<()> {
    match m {
        Move::Reduce {
            at,
            from,
            inputs,
            last,
        } => {
            let divisor = if last { mean } else { None };
            if !inputs {
                // `at`'s output holds its part already: the others' accumulate onto it.
                return emit(DeviceOp::Reduce {
                    at,
                    dst: recv[at],
                    srcs: from
                        .iter()
                        .filter(|&j| j != at)
                        .map(|j| (j, recv[j]))
                        .collect(),
                    accumulate: true,
                    divisor,
                    produced: true,
                });
            }
            if !from.any_but(at) && divisor.is_none() {
                // Nothing to reduce: the input becomes the output.
                if send[at] == recv[at] {
                    return Ok(());
                }
                return emit(DeviceOp::Copy {
                    to: at,
                    dst: recv[at],
                    from: at,
                    src: send[at],
                    produced: false,
                });
            }
            emit(DeviceOp::Reduce {
                at,
                dst: recv[at],
                srcs: from.iter().map(|j| (j, send[j])).collect(),
                accumulate: false,
                divisor,
                produced: false,
            })
        }
        Move::Copy { from, to } => {
            for j in to.iter().filter(|&j| j != from) {
                emit(DeviceOp::Copy {
                    to: j,
                    dst: recv[j],
                    from,
                    src: recv[from],
                    produced: true,
                })?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::algorithm::CopyAlgorithm;

    /// Run `algo`'s all-reduce on a model of P devices' memory, one op at a time, checking that
    /// an op that reads what another device wrote in this call waits for it; return each
    /// device's output.
    fn run(algo: CopyAlgorithm, p: usize, in_place: bool, mean: bool) -> Vec<Vec<f64>> {
        let n = 5;
        let send: Vec<u64> = (0..p as u64).map(|d| 0x1000 * (d + 1)).collect();
        let recv: Vec<u64> = if in_place {
            send.clone()
        } else {
            send.iter().map(|a| a + 0x800).collect()
        };
        let mut mem: HashMap<u64, Vec<f64>> = HashMap::new();
        for (d, &a) in send.iter().enumerate() {
            mem.insert(a, (0..n).map(|i| (10 * (d + 1) + i) as f64).collect());
        }
        for &a in &recv {
            mem.entry(a).or_insert_with(|| vec![f64::NAN; n]);
        }
        let mut writer: HashMap<u64, usize> = HashMap::new();
        let divisor = (mean && p > 1).then_some(p);
        algo.moves(p, |m| {
            lower(m, &send, &recv, divisor, |op| {
                match op {
                    DeviceOp::Copy {
                        to,
                        dst,
                        from,
                        src,
                        produced,
                    } => {
                        assert_ne!((to, dst), (from, src), "{algo:?} P={p}: a copy onto itself");
                        let w = writer.get(&src).copied();
                        assert!(
                            produced || w.is_none_or(|w| w == to),
                            "{algo:?} P={p}: {m:?} reads {src:#x} unordered"
                        );
                        let v = mem[&src].clone();
                        mem.insert(dst, v);
                        writer.insert(dst, to);
                    }
                    DeviceOp::Reduce {
                        at,
                        dst,
                        srcs,
                        accumulate,
                        divisor,
                        produced,
                    } => {
                        let mut acc = if accumulate {
                            mem[&dst].clone()
                        } else {
                            vec![0.0; n]
                        };
                        for &(d, a) in &srcs {
                            let w = writer.get(&a).copied();
                            assert!(
                                produced || w.is_none_or(|w| w == at),
                                "{algo:?} P={p}: {m:?} reads {a:#x} of device {d} unordered"
                            );
                            for (x, y) in acc.iter_mut().zip(&mem[&a]) {
                                *x += y;
                            }
                        }
                        if let Some(k) = divisor {
                            acc.iter_mut().for_each(|x| *x /= k as f64);
                        }
                        mem.insert(dst, acc);
                        writer.insert(dst, at);
                    }
                }
                Ok(())
            })
        })
        .unwrap();
        recv.iter().map(|a| mem[a].clone()).collect()
    }

    #[test]
    fn every_copy_schedule_all_reduces_on_device_memory() {
        for p in 1..=7 {
            for algo in CopyAlgorithm::every(p) {
                for in_place in [false, true] {
                    for mean in [false, true] {
                        let scale = if mean { p as f64 } else { 1.0 };
                        let want: Vec<f64> = (0..5)
                            .map(|i| (1..=p).map(|d| (10 * d + i) as f64).sum::<f64>() / scale)
                            .collect();
                        for (d, got) in run(algo, p, in_place, mean).iter().enumerate() {
                            assert_eq!(
                                got, &want,
                                "{algo:?} P={p} in_place={in_place} mean={mean}: device {d}"
                            );
                        }
                    }
                }
            }
        }
    }
}
