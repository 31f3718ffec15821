//! A dense tensor (row-major data and a shape), enough for `reduce` and `gather` along an axis.

use crate::dtype::kernels::{self, Init};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};

/// Row-major data with a shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T> {
    /// The elements, row-major.
    pub data: Vec<T>,
    /// The dimensions.
    pub shape: Vec<usize>,
}

impl<T: Element> Tensor<T> {
    /// A tensor of `shape` over `data`; the sizes must agree.
    pub fn new(data: Vec<T>, shape: Vec<usize>) -> Result<Tensor<T>> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::config(format!(
                "tensor: shape {shape:?} holds {n} elements, the data {}",
                data.len()
            )));
        }
        Ok(Tensor { data, shape })
    }

    /// A vector.
    pub fn vector(data: Vec<T>) -> Tensor<T> {
        let n = data.len();
        Tensor {
            data,
            shape: vec![n],
        }
    }

    fn split(&self, axis: usize) -> Result<(usize, usize, usize)> {
        if axis >= self.shape.len() {
            return Err(Error::config(format!(
                "axis {axis} is out of range for a tensor of shape {:?}",
                self.shape
            )));
        }
        let outer = self.shape[..axis].iter().product();
        let inner = self.shape[axis + 1..].iter().product();
        Ok((outer, self.shape[axis], inner))
    }

    /// Combine along `axis` with `op` (`Sum`; the axis disappears from the shape).
    pub fn reduce_axis(&self, axis: usize, op: ReduceOp) -> Result<Tensor<T>> {
        let (outer, len, inner) = self.split(axis)?;
        let mut out = vec![T::from_f64(0.0); outer * inner];
        for o in 0..outer {
            let srcs: Vec<&[u8]> = (0..len)
                .map(|k| {
                    bytemuck::cast_slice(
                        &self.data[(o * len + k) * inner..(o * len + k + 1) * inner],
                    )
                })
                .collect();
            if !srcs.is_empty() {
                kernels::reduce(
                    T::DTYPE,
                    op,
                    bytemuck::cast_slice_mut(&mut out[o * inner..(o + 1) * inner]),
                    &srcs,
                    Init::Overwrite,
                    None,
                );
            }
        }
        let mut shape = self.shape.clone();
        shape.remove(axis);
        Ok(Tensor { data: out, shape })
    }

    /// Concatenate along `axis`; the shapes must agree on every other axis.
    pub fn concat(parts: &[Tensor<T>], axis: usize) -> Result<Tensor<T>> {
        let Some(first) = parts.first() else {
            return Err(Error::config("concat: no tensors"));
        };
        let (outer, _, inner) = first.split(axis)?;
        let mut shape = first.shape.clone();
        shape[axis] = 0;
        for p in parts {
            let same = p.shape.len() == first.shape.len()
                && p.shape
                    .iter()
                    .zip(&first.shape)
                    .enumerate()
                    .all(|(i, (a, b))| i == axis || a == b);
            if !same {
                return Err(Error::config(format!(
                    "concat along axis {axis}: shapes {:?} and {:?} differ on another axis",
                    first.shape, p.shape
                )));
            }
            shape[axis] += p.shape[axis];
        }
        let mut data = Vec::with_capacity(shape.iter().product());
        for o in 0..outer {
            for p in parts {
                let len = p.shape[axis];
                data.extend_from_slice(&p.data[o * len * inner..(o + 1) * len * inner]);
            }
        }
        Ok(Tensor { data, shape })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_and_concat_along_axes() {
        let t = Tensor::new((0..6).map(|x| x as f32).collect(), vec![2, 3]).unwrap();
        assert_eq!(
            t.reduce_axis(0, ReduceOp::Sum).unwrap(),
            Tensor::new(vec![3.0, 5.0, 7.0], vec![3]).unwrap()
        );
        assert_eq!(
            t.reduce_axis(1, ReduceOp::Sum).unwrap(),
            Tensor::new(vec![3.0, 12.0], vec![2]).unwrap()
        );
        let u = Tensor::new(vec![9.0f32, 9.0], vec![2, 1]).unwrap();
        let c = Tensor::concat(&[t.clone(), u], 1).unwrap();
        assert_eq!(c.shape, vec![2, 4]);
        assert_eq!(c.data, vec![0.0, 1.0, 2.0, 9.0, 3.0, 4.0, 5.0, 9.0]);
        assert!(Tensor::concat(&[t.clone(), Tensor::vector(vec![1.0])], 0).is_err());
        assert!(t
            .reduce_axis(2, ReduceOp::Sum)
            .unwrap_err()
            .to_string()
            .contains("axis 2 is out of range"));
        assert!(Tensor::new(vec![1.0f32], vec![2]).is_err());
    }
}
