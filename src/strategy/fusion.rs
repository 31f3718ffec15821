//! Tensor fusion: pack many small tensors into few buffers so that fewer, larger collectives run
//! (TensorFlow's `bytes_per_pack`, Horovod's fusion threshold).

/// Group tensors (by index, in order) into packs of at most `bytes_per_pack` bytes; a tensor
/// larger than that travels alone. `bytes_per_pack = 0` gives one pack per tensor.
pub fn pack_plan(lens: &[usize], elem_size: usize, bytes_per_pack: usize) -> Vec<Vec<usize>> {
    let mut packs: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut bytes = 0;
    for (i, &len) in lens.iter().enumerate() {
        let b = len * elem_size;
        if bytes_per_pack == 0 || b >= bytes_per_pack {
            packs.push(vec![i]);
            continue;
        }
        if bytes + b > bytes_per_pack && !cur.is_empty() {
            packs.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        cur.push(i);
        bytes += b;
    }
    if !cur.is_empty() {
        packs.push(cur);
    }
    packs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_small_tensors_and_keeps_large_ones_alone() {
        assert_eq!(
            pack_plan(&[10, 10, 10, 100, 5], 4, 100),
            vec![vec![0, 1], vec![3], vec![2, 4]]
        );
        assert_eq!(pack_plan(&[1, 2, 3], 4, 0), vec![vec![0], vec![1], vec![2]]);
        assert_eq!(pack_plan(&[], 4, 64), Vec::<Vec<usize>>::new());
        let plan = pack_plan(&[1; 1000], 4, 1024);
        assert_eq!(plan.len(), 4);
        assert_eq!(plan.iter().map(|p| p.len()).sum::<usize>(), 1000);
    }
}
