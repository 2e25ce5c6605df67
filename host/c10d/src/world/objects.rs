//! Collectives on serialized objects (`dist.all_gather_object`), built on
//! the tensor collectives: sizes first, then the padded bytes.

use tch::Tensor;

use super::World;
use crate::error::Result;
use crate::group::ProcessGroup;

impl World {
    /// `dist.all_gather_object(object_list, obj, group)` for serialized
    /// objects: every member's bytes, in group-rank order (empty outside the
    /// group). Two all_gathers, sizes then padded bytes, as PyTorch does.
    ///
    /// # Errors
    /// Collective errors.
    pub async fn all_gather_object(
        &self,
        obj: &[u8],
        group: Option<&ProcessGroup>,
    ) -> Result<Vec<Vec<u8>>> {
        let pg = match group {
            Some(g) => g.clone(),
            None => self.default_group()?,
        };
        if !pg.is_member() {
            self.target(Some(&pg), "all_gather_object")?;
            return Ok(Vec::new());
        }
        let n = pg.size();
        let size = Tensor::from_slice(&[obj.len() as i64]);
        let sizes: Vec<Tensor> = (0..n).map(|_| size.zeros_like()).collect();
        self.all_gather(&sizes, &size, Some(&pg))?.wait().await?;
        let lens: Vec<usize> = sizes.iter().map(|t| t.int64_value(&[0]) as usize).collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        let mut padded = obj.to_vec();
        padded.resize(max, 0);
        let mine = Tensor::from_slice(&padded);
        let outs: Vec<Tensor> = (0..n).map(|_| mine.zeros_like()).collect();
        self.all_gather(&outs, &mine, Some(&pg))?.wait().await?;
        Ok(outs
            .iter()
            .zip(lens)
            .map(|(t, len)| {
                let mut bytes = vec![0u8; max];
                t.copy_data_u8(&mut bytes, max);
                bytes.truncate(len);
                bytes
            })
            .collect())
    }
}
