use super::*;
use std::sync::Mutex;
use tch::{Device, Kind};

/// A one-member backend with only `alltoall_base`: it records the splits
/// and returns its input as the output, as a group of one does.
#[derive(Debug, Default)]
struct BaseOnly {
    splits: Mutex<Vec<(Vec<i64>, Vec<i64>)>>,
}

#[async_trait::async_trait]
impl CollectiveBackend for BaseOnly {
    fn name(&self) -> String {
        "base-only".into()
    }
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    async fn alltoall_base(
        &self,
        ctx: &OpContext,
        mut output: Tensor,
        input: Tensor,
        output_split: Vec<i64>,
        input_split: Vec<i64>,
    ) -> Result<()> {
        self.splits
            .lock()
            .unwrap()
            .push((output_split, input_split));
        output
            .f_copy_(&input)
            .map_err(|e| self.tensor_error(ctx, e))
    }
}

fn ctx() -> OpContext {
    OpContext {
        op: "all_to_all",
        seq: 0,
        sub: 0,
        timeout: Duration::from_secs(1),
        group: "0".into(),
    }
}

/// The packed path keeps each tensor's place, element count and shape:
/// what `all_to_all` of lists gives on libtorch 2.11's Gloo.
#[tokio::test]
async fn alltoall_through_base_packs_by_element_count_and_unpacks_in_shape() {
    let backend = BaseOnly::default();
    let opts = (Kind::Float, Device::Cpu);
    let inputs = [
        Tensor::arange(6, opts).reshape([2, 3]),
        Tensor::arange_start(6, 10, opts),
    ];
    let outputs = [Tensor::zeros([3, 2], opts), Tensor::zeros([2, 2], opts)];
    backend
        .alltoall_through_base(
            &ctx(),
            outputs.iter().map(Tensor::shallow_clone).collect(),
            inputs.iter().map(Tensor::shallow_clone).collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        *backend.splits.lock().unwrap(),
        vec![(vec![6, 4], vec![6, 4])]
    );
    assert!(outputs[0].equal(&Tensor::arange(6, opts).reshape([3, 2])));
    assert!(outputs[1].equal(&Tensor::arange_start(6, 10, opts).reshape([2, 2])));
}
