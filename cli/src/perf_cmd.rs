//! `tutti perf`: its arguments checked, the sweep over sizes and algorithms, the plot and the
//! overlap measurement.

use super::*;

/// Everything about `tutti perf`'s arguments that can be wrong, checked before anything is
/// printed or measured.
fn check_perf_args(a: &PerfArgs) -> Result<(), tutti::Error> {
    let bad = |m: String| Err(tutti::Error::config(m));
    if a.factor < 2 {
        return bad(format!(
            "-f {}: the step factor between sizes must be at least 2",
            a.factor
        ));
    }
    if a.iters == Some(0) {
        return bad("--iters 0: measure at least one iteration".into());
    }
    if a.ranks == Some(0) {
        return bad("-n 0: perf needs at least one rank".into());
    }
    if a.collective == Collective::Barrier {
        return bad("-c barrier: perf measures collectives that move data".into());
    }
    if let (true, Err(m)) = (perf::reduces(a.collective), a.op.check(a.dtype)) {
        return bad(format!(
            "-o {} -d {}: {m}; pick an integer type with -d (i8, u8, i32, u32, i64, u64)",
            a.op, a.dtype
        ));
    }
    if let Some(root) = a.root {
        if !perf::rooted(a.collective) {
            return bad(format!(
                "-r {root}: {} has no root (broadcast, reduce, gather and scatter do)",
                a.collective.cli_name()
            ));
        }
        if let Some(n) = a.ranks.filter(|&n| root >= n) {
            return bad(format!("-r {root}: out of range for {n} ranks (-n {n})"));
        }
    }
    if let Some(path) = &a.plot {
        // Found now rather than after the whole sweep.
        let dir = std::path::Path::new(path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        if !dir.is_dir() {
            return bad(format!(
                "--plot {path}: the directory {} does not exist",
                dir.display()
            ));
        }
    }
    if a.shared_buffers && a.device != DeviceKind::Cpu {
        return Err(tutti::Error::config(format!(
            "--shared-buffers: shared buffers are host memory of cpu ranks, not {} devices",
            a.device
        )));
    }
    if matches!(a.collective, Collective::Send | Collective::Recv) {
        return bad(format!(
            "-c {}: point-to-point is measured as nccl-tests does, with -c send-recv",
            a.collective.cli_name()
        ));
    }
    // Named before the device's own availability: the collective is the first thing wrong.
    perf::device_measures(a.device, a.collective)?;
    if a.in_place && !perf::has_in_place(a.collective) {
        return bad(format!(
            "--in-place: {} has no in-place form; it is measured out of place only (drop \
             --in-place)",
            a.collective.cli_name()
        ));
    }
    if a.device == DeviceKind::Xla && a.in_place {
        return bad(
            "--in-place: XLA collectives write new device buffers (drop --in-place)".into(),
        );
    }
    let esize = a.dtype.size();
    let split = perf::splits(a.collective);
    let least = if split {
        esize * a.ranks.unwrap_or(1)
    } else {
        esize
    };
    if !perf::sizes(a.min_bytes, a.max_bytes, a.factor)
        .iter()
        .any(|&b| b >= least)
    {
        return bad(format!(
            "-b {} -e {}: no size holds {}; nothing to measure",
            a.min_bytes,
            a.max_bytes,
            if split {
                format!("one {} element per rank", a.dtype)
            } else {
                format!("one {} element", a.dtype)
            }
        ));
    }
    match a.device {
        DeviceKind::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        DeviceKind::Gpu => tutti::gpu::devices().map(drop),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Gpu => Err(tutti::Error::Unavailable {
            what: "GPU".into(),
            why: "this build of tutti has no CUDA support (build with --features cuda)".into(),
        }),
        #[cfg(feature = "xla")]
        DeviceKind::Xla => Ok(()),
        #[cfg(not(feature = "xla"))]
        DeviceKind::Xla => Err(tutti::Error::Unavailable {
            what: "XLA".into(),
            why: "this build of tutti has no PJRT support (build with --features xla)".into(),
        }),
    }
}

/// `tutti perf`: one sweep, or one per algorithm asked for, on this process's ranks or devices.
pub(crate) fn run(a: PerfArgs) -> Result<(), tutti::Error> {
    let mut config = config_with_timeout(a.timeout)?;
    if a.deterministic {
        config = config.with_deterministic(true);
    }
    if let Some(c) = a.compression {
        config = config.with_compression(c);
    }
    if a.min_bytes > a.max_bytes {
        return Err(tutti::Error::config(format!(
            "-b {} is larger than -e {}: nothing to measure",
            a.min_bytes, a.max_bytes
        )));
    }
    // `-a ring,direct`: one sweep per algorithm (and per transport given), one line each in
    // the plot.
    let algos = a
        .algo
        .split(',')
        .map(|name| perf_algorithm(&a, name.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    check_perf_args(&a)?;
    let transports: Vec<Option<TransportKind>> = if a.transport.is_empty() {
        vec![None]
    } else {
        a.transport.iter().copied().map(Some).collect()
    };
    if a.overlap && algos.len() * transports.len() > 1 {
        return Err(tutti::Error::config(
            "--overlap measures one algorithm on one transport (one -a, one --transport)",
        ));
    }
    let mut machine = None;
    let mut series: Vec<(String, Vec<perf::Row>)> = Vec::new();
    let mut lead = true;
    for &transport in &transports {
        let mut comm = launched_comm(transport, &config.clone().with_algorithm(algos[0].core))?;
        if comm.is_none() && transport.is_some() {
            return Err(tutti::Error::config(
                "--transport applies to the processes of a launched job (tutti launch -n 2 -- \
                 tutti perf --transport tcp); without a launcher the ranks are threads",
            ));
        }
        match &comm {
            Some(c) => launched_ranks(a.ranks, c)?,
            None => threads_fit(a.ranks, a.device)?,
        }
        if let Some(c) = &comm {
            for algo in &algos {
                direct_between_processes(&a, algo.core, c)?;
            }
        }
        if a.overlap {
            return overlap_cmd(&a, comm, config.with_algorithm(algos[0].core));
        }
        lead = comm.as_ref().is_none_or(|c| c.rank() == 0);
        for algo in &algos {
            if let Some(c) = &mut comm {
                c.set_algorithm(algo.core)?;
            }
            let rows = sweep(&a, comm.as_ref(), algo, transport, &config, &mut machine)?;
            if config.compression != tutti::Compression::None && !a.json {
                compression_footer(comm.as_mut(), &config, lead)?;
            }
            let label = match (algos.len() > 1, transports.len() > 1, transport) {
                (true, true, Some(t)) => format!("{}, {t}", algo.name),
                (false, true, Some(t)) => t.to_string(),
                _ => algo.name.clone(),
            };
            series.push((label, rows));
        }
    }
    if let (Some(path), true) = (&a.plot, lead) {
        plot(path, &a, &series)?;
    }
    let wrong: u64 = series.iter().flat_map(|(_, r)| r).map(|r| r.errors).sum();
    if wrong > 0 {
        return Err(tutti::Error::System {
            what: "perf".into(),
            message: format!("{wrong} elements differed from the reference"),
        });
    }
    Ok(())
}

/// Under `--compression`: the error the wire adds to an f32 all-reduce of random values, and
/// whether every rank holds the same bits (or why nothing was compressed).
fn compression_footer(
    comm: Option<&mut Communicator>,
    config: &Config,
    lead: bool,
) -> Result<(), tutti::Error> {
    let Some(comm) = comm.filter(|c| c.compression() != tutti::Compression::None) else {
        if lead {
            say!(
                "# compression {}: not applied on these ranks (no peer over TCP, or a device \
                 engine's)",
                config.compression
            );
        }
        return Ok(());
    };
    // Measured on the ring, which carries the wire whatever algorithm the sweep forced.
    let swept = comm.algorithm();
    comm.set_algorithm(tutti::Algorithm::Ring)?;
    let e = tutti::perf::compression_error(comm, 1 << 18);
    comm.set_algorithm(swept)?;
    let e = e?;
    if lead {
        say!(
            "# compression {}: f32 ring all-reduce of {} random values in [-1, 1) per rank: largest \
             error {:.2e}, RMS {:.2e} (relative to the sum of magnitudes); ranks {}",
            config.compression,
            e.count,
            e.max,
            e.rms,
            if e.agree {
                "hold the same bits"
            } else {
                "DIFFER"
            }
        );
    }
    Ok(())
}

/// `-n` on CPU threads: no more than an in-process group may have (said before the header).
fn threads_fit(ranks: Option<usize>, device: DeviceKind) -> Result<(), tutti::Error> {
    match ranks {
        Some(n) if device == DeviceKind::Cpu && n > tutti::MAX_LOCAL_RANKS => {
            Err(tutti::Error::config(format!(
                "-n {n}: an in-process group has at most {} ranks (threads); run larger jobs \
                 as processes (tutti launch -n {n} -- tutti perf)",
                tutti::MAX_LOCAL_RANKS
            )))
        }
        _ => Ok(()),
    }
}

/// `-a direct` between processes reads the peers' buffers in place: only on shared buffers,
/// from the size where calls run through them (per rank's block where the collective cuts
/// one), and not for reduce and gather, whose ranks off the root have no output to share,
/// scatter, whose ranks off the root have no input, or the `-v` forms, whose ranks' buffers
/// differ in length (they run on the slots). Found before anything is printed.
fn direct_between_processes(
    a: &PerfArgs,
    algo: Algorithm,
    comm: &Communicator,
) -> Result<(), tutti::Error> {
    if algo != Algorithm::Direct || comm.world_size() == 1 || comm.has_peer_memory() {
        return Ok(());
    }
    let no = |why: String| {
        Err(tutti::Error::config(format!(
            "-a direct between processes: {why}"
        )))
    };
    if !a.shared_buffers {
        return no(
            "direct reads the peers' buffers in place, which separate processes can only do \
             on shared buffers (add --shared-buffers)"
                .into(),
        );
    }
    match a.collective {
        Collective::Reduce | Collective::Gather => {
            return no(format!(
                "a {}'s ranks off the root have no output to share, so it runs on the \
                 shared-memory slots (use another algorithm)",
                a.collective.cli_name()
            ))
        }
        Collective::Scatter => {
            return no(
                "a scatter's ranks off the root have no input to share, so it runs on the \
                 shared-memory slots (use another algorithm)"
                    .into(),
            )
        }
        Collective::AllGatherV | Collective::ReduceScatterV | Collective::AllToAllV => {
            return no(format!(
                "the ranks of {} hold buffers of different lengths, which run on the \
                 shared-memory slots, not on shared buffers (use another algorithm)",
                a.collective.cli_name()
            ))
        }
        _ => {}
    }
    if !comm.can_share_buffers() {
        return no("some ranks are not on shared memory of this host (--transport shm)".into());
    }
    // Every rank runs this alike: the threshold is known once the communicator allocated.
    drop(comm.alloc_shared(1)?);
    let min = comm.shared_min_bytes();
    // A call's size as the threshold counts it: per rank's piece where the collective splits.
    let per_rank = if perf::splits(a.collective) {
        comm.world_size()
    } else {
        1
    };
    let esize = a.dtype.size();
    if a.min_bytes / esize / per_rank * esize < min {
        return no(format!(
            "calls of {} run through shared buffers from {min} bytes{}; smaller ones run on \
             the slots (start the sweep there: -b {})",
            a.collective.cli_name(),
            if per_rank > 1 { " per rank" } else { "" },
            min * per_rank
        ));
    }
    Ok(())
}

/// One algorithm of `-a`, as the core and (with CUDA) the GPU harness take it.
struct PerfAlgorithm {
    name: String,
    core: Algorithm,
    #[cfg(feature = "cuda")]
    gpu: tutti::gpu::GpuAlgorithm,
}

fn perf_algorithm(a: &PerfArgs, name: &str) -> Result<PerfAlgorithm, tutti::Error> {
    // `nccl` names a GPU algorithm only; the other names are the core algorithms.
    let gpu = a.device == DeviceKind::Gpu;
    let core: Algorithm = match name.parse() {
        Ok(x) => x,
        // GPU names (nccl among them) are checked with the GPU algorithms.
        Err(_) if gpu => Algorithm::Auto,
        Err(_) if name.eq_ignore_ascii_case("nccl") => {
            return Err(tutti::Error::config(
                "-a nccl: NCCL runs on GPUs (--device gpu)",
            ))
        }
        Err(e) => return Err(tutti::Error::config(format!("-a: {e}"))),
    };
    #[cfg(feature = "cuda")]
    let gpu_algo: tutti::gpu::GpuAlgorithm = name
        .parse()
        .map_err(|e| tutti::Error::config(format!("-a: {e}")))
        .or_else(|e| if gpu { Err(e) } else { Ok(Default::default()) })?;
    Ok(PerfAlgorithm {
        name: if gpu {
            name.to_ascii_lowercase()
        } else {
            core.to_string()
        },
        core,
        #[cfg(feature = "cuda")]
        gpu: gpu_algo,
    })
}

/// `tutti perf --plot FILE.svg`: busbw against size, a line per algorithm or transport.
fn plot(path: &str, a: &PerfArgs, series: &[(String, Vec<perf::Row>)]) -> Result<(), tutti::Error> {
    use plotters::prelude::*;
    let fail = |e: String| tutti::Error::System {
        what: format!("--plot {path}"),
        message: e,
    };
    // Out of place where both were measured: one line per series.
    let points: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(label, rows)| {
            let any_out = rows.iter().any(|r| !r.in_place);
            let pts = rows
                .iter()
                .filter(|r| r.in_place != any_out)
                .map(|r| (r.bytes as f64, r.busbw_gbps))
                .collect();
            (label.as_str(), pts)
        })
        .collect();
    let all = || points.iter().flat_map(|(_, p)| p.iter());
    let (lo, hi) = all().fold((f64::MAX, 0f64), |(lo, hi), &(x, _)| (lo.min(x), hi.max(x)));
    let top = all().fold(0f64, |m, &(_, y)| m.max(y)).max(1e-3) * 1.1;
    if points.iter().all(|(_, p)| p.is_empty()) {
        return Err(fail("nothing was measured".into()));
    }
    let rows = &series[0].1;
    let title = format!(
        "tutti perf: {} {} on {} ranks",
        a.collective.cli_name(),
        a.dtype,
        rows.first().map_or(0, |r| r.ranks)
    );
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d((lo..hi.max(lo * 2.0)).log_scale(), 0f64..top)?;
        chart
            .configure_mesh()
            .x_desc("bytes")
            .y_desc("busbw (GB/s)")
            .x_label_formatter(&|b| size_label(*b))
            .draw()?;
        for (i, (label, pts)) in points.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
                .label(*label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.85))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| fail(e.to_string()))
}

/// `10k`, `1M`: a size on the plot's axis (whose ticks are powers of ten).
fn size_label(bytes: f64) -> String {
    match bytes {
        b if b >= 1e9 => format!("{}G", b / 1e9),
        b if b >= 1e6 => format!("{}M", b / 1e6),
        b if b >= 1e3 => format!("{}k", b / 1e3),
        b => format!("{b}"),
    }
}

/// One sweep of sizes with one algorithm: its table (or JSON lines) from rank 0, and its rows.
fn sweep(
    a: &PerfArgs,
    comm: Option<&Communicator>,
    algo: &PerfAlgorithm,
    transport: Option<TransportKind>,
    config: &Config,
    machine_out: &mut Option<perf::Machine>,
) -> Result<Vec<perf::Row>, tutti::Error> {
    let gpu = a.device == DeviceKind::Gpu;
    let config = config.clone();
    let defaults = Options::default();
    let opts = Options {
        collective: a.collective,
        algorithm: algo.core,
        ranks: comm
            .as_ref()
            .map_or(a.ranks.unwrap_or(defaults.ranks), |c| c.world_size()),
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        factor: a.factor,
        dtype: a.dtype,
        op: a.op,
        device: a.device,
        shared_buffers: a.shared_buffers,
        placement: if a.in_place {
            Placement::InPlace
        } else if a.out_of_place || a.device == DeviceKind::Xla || !perf::has_in_place(a.collective)
        {
            // XLA collectives write new buffers, and all-to-all, gather, scatter and the `-v`
            // forms have no in-place call: out of place is all there is.
            Placement::OutOfPlace
        } else {
            Placement::Both
        },
        root: a.root.unwrap_or(0),
        iters: a.iters,
        config,
    };
    // The world size of a launched job is known only now, and before anything is measured.
    opts.check_root(opts.ranks)?;
    if opts.device == DeviceKind::Cpu {
        opts.config
            .clone()
            .with_algorithm(opts.algorithm)
            .check(opts.ranks)?;
    }
    let lead = comm.as_ref().is_none_or(|c| c.rank() == 0);
    // Rank 0 measures the machine once for the header, while the others wait (CPU rows time
    // their own copies, see `tutti::perf`).
    let machine = match machine_out {
        Some(m) => m.clone(),
        None if lead => perf::machine(comm.is_some())?,
        None => perf::Machine {
            copy_gbps: 0.0,
            cores: 0,
            cpu: String::new(),
            memory_bytes: 0,
            tcp_gbps: None,
            gpu_copy_gbps: None,
        },
    };
    #[cfg(feature = "cuda")]
    let machine = if gpu && comm.is_none() && machine.gpu_copy_gbps.is_none() {
        perf::Machine {
            gpu_copy_gbps: Some(tutti::gpu::device_copy_gbps(0)?),
            ..machine
        }
    } else {
        machine
    };
    *machine_out = Some(machine.clone());
    let carrier = match comm {
        Some(_) => {
            let named = transport.map_or_else(
                || std::env::var("TUTTI_TRANSPORT").unwrap_or_else(|_| "auto".into()),
                |t| t.to_string(),
            );
            // `auto` under an MPI launcher, in a build with MPI, is the MPI transport.
            let mpi = named
                .parse::<TransportKind>()
                .is_ok_and(|k| k == TransportKind::Auto && k.is_mpi_here());
            format!(
                "processes, transport {named}{}",
                if mpi { " (mpi)" } else { "" }
            )
        }
        None if a.device == DeviceKind::Xla => "XLA devices through PJRT".to_string(),
        None if gpu => "GPUs of this process".to_string(),
        None => "threads".to_string(),
    };
    if lead && a.json {
        say!("{}", serde_json::json!({ "machine": machine }));
    } else if lead {
        say!(
            "# tutti perf: {} algo {} on {} ranks ({carrier}), {}{}{}, {}, device {}{}{}{}",
            opts.collective.cli_name(),
            algo.name,
            opts.ranks,
            opts.dtype,
            // The op only where the collective reduces (a broadcast has none).
            if perf::reduces(opts.collective) {
                format!(" {}", opts.op)
            } else {
                String::new()
            },
            opts.rooted()
                .map_or(String::new(), |r| format!(", root {r}")),
            match opts.placement {
                Placement::OutOfPlace => "out of place",
                Placement::InPlace => "in place",
                Placement::Both => "out of place and in place",
            },
            opts.device,
            if opts.shared_buffers {
                ", shared buffers"
            } else {
                ""
            },
            if opts.config.deterministic {
                ", deterministic"
            } else {
                ""
            },
            match opts.config.compression {
                tutti::Compression::None => String::new(),
                c => format!(", f32 between hosts as {c}"),
            }
        );
        let tcp = machine.tcp_gbps.map_or(String::new(), |t| {
            format!(", loopback TCP {t:.2} GB/s per direction")
        });
        let gpu_copy = machine.gpu_copy_gbps.map_or(String::new(), |g| {
            format!(", GPU 0 device copy {g:.1} GB/s (read + write)")
        });
        say!(
            "# machine: copy bandwidth {:.1} GB/s (read + write, {} cores){tcp}{gpu_copy}, {}",
            machine.copy_gbps,
            machine.cores,
            machine.cpu
        );
        // nccl-tests' layout: size, count and root, then a group of columns per placement.
        let group = format!(
            "{:>11} {:>11} {:>11} {:>9} {:>7}",
            "time(us)", "algbw(GB/s)", "busbw(GB/s)", "mem_ratio", "errors"
        );
        let runs = opts.placement.runs();
        let titles: Vec<String> = runs
            .iter()
            .map(|&p| format!("{:>52}", if p { "in place" } else { "out of place" }))
            .collect();
        say!("# {:>12} {:>12} {:>5}{}", "", "", "", titles.join(" "));
        // Then, on CPU ranks, what the calls ran as (the algorithm `auto` chose).
        say!(
            "# {:>12} {:>12} {:>5} {}{}",
            "bytes",
            "count",
            "root",
            vec![group; runs.len()].join(" "),
            if opts.device == DeviceKind::Cpu {
                "  ran"
            } else {
                ""
            }
        );
    }
    let json = a.json;
    let both = opts.placement == Placement::Both;
    // With both placements a size's line waits for its in-place row.
    let out_of_place: std::sync::Mutex<Option<perf::Row>> = Default::default();
    let emit = |row: &perf::Row| {
        if json {
            say!("{}", serde_json::to_string(row).expect("a row serializes"));
            return;
        }
        let mut held = out_of_place.lock().unwrap_or_else(|e| e.into_inner());
        if both && !row.in_place {
            *held = Some(row.clone());
            return;
        }
        let group = |r: &perf::Row| {
            format!(
                "{:>11.1} {:>11.2} {:>11.2} {:>9.2} {:>7}",
                r.time_us, r.algbw_gbps, r.busbw_gbps, r.mem_ratio, r.errors
            )
        };
        let groups: Vec<String> = held.take().iter().chain([row]).map(group).collect();
        say!(
            "  {:>12} {:>12} {:>5} {}{}",
            row.bytes,
            row.count,
            row.root.map_or(-1, |r| r as i64),
            groups.join(" "),
            row.ran.as_ref().map_or(String::new(), |r| format!("  {r}"))
        );
    };
    let rows = match comm {
        Some(c) => perf::run_on(c, &opts, &emit)?,
        #[cfg(feature = "cuda")]
        None if gpu => {
            let gbps = machine.gpu_copy_gbps.unwrap_or_default();
            tutti::perf::gpu::run(&opts, algo.gpu, gbps, &emit)?
        }
        None => perf::run(&opts, &machine, &emit)?,
    };
    if lead && !json && !rows.is_empty() {
        // nccl-tests' closing line: the mean bus bandwidth over the sizes measured.
        let avg = rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64;
        say!("# Avg bus bandwidth    : {avg:.3}");
    }
    Ok(rows)
}

/// `tutti perf --overlap`: each size's all-reduce, computation and both overlapped.
fn overlap_cmd(
    a: &PerfArgs,
    comm: Option<Communicator>,
    config: Config,
) -> Result<(), tutti::Error> {
    if a.collective != Collective::AllReduce || a.device != DeviceKind::Cpu {
        return Err(tutti::Error::config(
            "--overlap measures the f32 all-reduce on CPU ranks (-c all-reduce, --device cpu)",
        ));
    }
    let sizes = perf::sizes(a.min_bytes, a.max_bytes, a.factor);
    let iters = a.iters.unwrap_or(20);
    let json = a.json;
    let run = |c: &Communicator| -> Result<(), tutti::Error> {
        let lead = c.rank() == 0;
        if lead && !json {
            say!(
                "# tutti perf --overlap: all-reduce f32 sum, algo {}, {} ranks, {iters} iterations; ratio = overlapped / (compute + all-reduce), 1.0 = no overlap",
                c.algorithm(),
                c.world_size()
            );
            say!(
                "# {:>12} {:>14} {:>12} {:>15} {:>7}",
                "bytes",
                "all_reduce(us)",
                "compute(us)",
                "overlapped(us)",
                "ratio"
            );
        }
        for &bytes in &sizes {
            let row = perf::overlap_one(c, bytes, iters)?;
            if lead && json {
                say!("{}", serde_json::to_string(&row).expect("a row serializes"));
            } else if lead {
                say!(
                    "  {:>12} {:>14.1} {:>12.1} {:>15.1} {:>7.2}",
                    row.bytes,
                    row.all_reduce_us,
                    row.compute_us,
                    row.overlapped_us,
                    row.ratio
                );
            }
        }
        Ok(())
    };
    match comm {
        Some(c) => run(&c),
        None => tutti::run_local(a.ranks.unwrap_or(2), &config, run)?
            .into_iter()
            .collect(),
    }
}
