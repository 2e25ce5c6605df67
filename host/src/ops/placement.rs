//! Where tensor work runs (OPS-1): in place, on the runtime thread that
//! asks for it, or on tokio's blocking pool. This module owns the estimate
//! of what an op or a piece of a backward pass costs, from its tensors'
//! shapes alone, and the bounds under which that work runs in place; the
//! callers (`ops::run_builtin`, the plugins' op host function, the
//! distributed autograd engine) only ask [`Work::runs_in_place`].
//!
//! Why run anything in place: the hop to the pool and back is two thread
//! wake-ups, which cost 20-40 µs on a quiet 2-core VM and up to 700 µs in
//! its slow phases, more than a 256x256 matmul (`wasmrpc-bench anatomy
//! --call matmul256`, 2026-12-03: 1.45-1.63 ms through the pool against
//! 0.76-0.82 ms in place). Why not everything: an op holds the runtime
//! thread while it runs, and with it the connections' readers, heartbeats
//! and other calls on that thread. So only work whose cost the shapes
//! bound, and which stays under about half a millisecond on one core of
//! that VM ([`IN_PLACE_MULTIPLY_ADDS`], [`IN_PLACE_ELEMENTS`]), runs in
//! place; anything else, or anything whose cost the shapes do not bound
//! (sizes from integer arguments, lists of tensors, user hooks, deep
//! graphs of large tensors), goes to the pool.

/// The most multiply-adds work may take in place: the backward of a
/// 256x256 matmul (two products of 256³ multiply-adds), 0.55 ms on one core
/// of the 2-core VM we measure on.
pub(crate) const IN_PLACE_MULTIPLY_ADDS: u64 = 1 << 25;

/// The most elements work may read or write in place: 1 MiB of float32,
/// 0.1-0.3 ms for an elementwise op over them.
pub(crate) const IN_PLACE_ELEMENTS: u64 = 1 << 18;

/// Tensors of at most this many elements make a backward graph of up to
/// [`SMALL_GRAPH_NODES`] nodes cheap at any depth: its hidden intermediate
/// tensors, which no estimate sees, are then small too (a 32x32 matmul is
/// 32k multiply-adds, a few microseconds).
pub(crate) const SMALL_ELEMENTS: u64 = 1024;

/// The most nodes a backward graph of [`SMALL_ELEMENTS`] tensors may have
/// to run in place.
pub(crate) const SMALL_GRAPH_NODES: usize = 32;

/// Products: ops whose work is multiply-adds over a shared dimension
/// (names without the `aten::` namespace).
const PRODUCT_OPS: &[&str] = &["addmm", "bmm", "dot", "matmul", "mm", "mv"];

/// What a piece of tensor work costs at most, as far as its tensors'
/// shapes bound it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Work {
    /// Multiply-adds of the products it computes.
    pub(crate) multiply_adds: u64,
    /// Elements it reads or writes outside the products.
    pub(crate) elements: u64,
}

impl Work {
    /// Whether this work runs in place rather than on the blocking pool.
    pub(crate) fn runs_in_place(self) -> bool {
        self.multiply_adds <= IN_PLACE_MULTIPLY_ADDS && self.elements <= IN_PLACE_ELEMENTS
    }

    /// The work of the op `base` (a name without namespace, from the ops
    /// whose work the tensors bound) on tensors of these shapes: for a
    /// product its multiply-adds and the elements of its operands and
    /// output, for any other op the elements of its largest input or of
    /// their broadcast. `None` when the shapes do not fit the op (left to
    /// the op to refuse, on the pool).
    pub(crate) fn of_op(base: &str, shapes: &[&[i64]]) -> Option<Work> {
        let inputs = shapes.iter().map(|s| elements(s)).max().unwrap_or(0);
        if !PRODUCT_OPS.contains(&base) {
            let broadcast = broadcast_elements(shapes);
            return Some(Work {
                multiply_adds: 0,
                elements: inputs.max(broadcast),
            });
        }
        // `addmm(input, mat1, mat2)`: the product is of the last two.
        let [a, b] = match shapes {
            [a, b] if base != "addmm" => [a, b],
            [_, a, b] if base == "addmm" => [a, b],
            _ => return None,
        };
        let (multiply_adds, output) = product(a, b)?;
        Some(Work {
            multiply_adds,
            elements: inputs.max(output),
        })
    }

    /// The work of a backward pass through a shallow graph (every node's
    /// inputs and outputs are among the tensors the walk saw, none of more
    /// than `max_elements` elements) of `nodes` nodes, `products` of them
    /// the backward of a product: each such backward computes two products
    /// of at most `max_elements`^1.5 multiply-adds (for `m·k·n` with `m·k`,
    /// `k·n` and `m·n` all at most `e`, `m·k·n` is at most `e`^1.5), and
    /// every node reads or writes at most `max_elements` elements.
    pub(crate) fn of_backward(nodes: usize, products: usize, max_elements: u64) -> Work {
        let per_product = max_elements.saturating_mul(max_elements.isqrt());
        Work {
            multiply_adds: per_product.saturating_mul(2 * products as u64),
            elements: max_elements.saturating_mul(nodes as u64),
        }
    }
}

/// Whether the autograd node named `name` (`MmBackward0`, `AddBackward0`,
/// `torch::autograd::AccumulateGrad`) is the backward of a product, of an
/// op whose work its tensors bound, or neither (`None`).
pub(crate) fn backward_node_kind(name: &str) -> Option<NodeKind> {
    if name.ends_with("AccumulateGrad") {
        return Some(NodeKind::Bounded);
    }
    let op = name
        .trim_end_matches(|c: char| c.is_ascii_digit())
        .strip_suffix("Backward")?
        .to_ascii_lowercase();
    if PRODUCT_OPS.contains(&op.as_str()) {
        Some(NodeKind::Product)
    } else if super::BOUNDED_OPS.contains(&op.as_str()) {
        Some(NodeKind::Bounded)
    } else {
        None
    }
}

/// What [`backward_node_kind`] tells of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeKind {
    /// The backward of a product (`mm`, `bmm`, `addmm`, ...).
    Product,
    /// The backward of an elementwise op or reduction, or a gradient's
    /// accumulation.
    Bounded,
}

fn elements(shape: &[i64]) -> u64 {
    shape.iter().fold(1_u64, |n, &d| {
        n.saturating_mul(u64::try_from(d).unwrap_or(0))
    })
}

/// The element count of the shapes broadcast together (each dimension the
/// largest of the aligned ones, as broadcasting makes it when it applies).
fn broadcast_elements(shapes: &[&[i64]]) -> u64 {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut dims = vec![0_i64; rank];
    for shape in shapes {
        for (i, &d) in shape.iter().rev().enumerate() {
            dims[i] = dims[i].max(d);
        }
    }
    elements(&dims)
}

/// The multiply-adds and the output's elements of `matmul(a, b)` by its
/// rules (a 1-D operand is a row or a column; leading dimensions broadcast
/// as batches), which `mm`, `bmm`, `mv` and `dot` follow too.
fn product(a: &[i64], b: &[i64]) -> Option<(u64, u64)> {
    let dim = |d: i64| u64::try_from(d).ok();
    let (m, k) = match a {
        [] => return None,
        [k] => (1, dim(*k)?),
        [.., m, k] => (dim(*m)?, dim(*k)?),
    };
    let n = match b {
        [] => return None,
        [_] => 1,
        [.., n] => dim(*n)?,
    };
    let batch_of = |s: &[i64]| -> Vec<i64> { s[..s.len().saturating_sub(2)].to_vec() };
    let (ba, bb) = (batch_of(a), batch_of(b));
    let batch = broadcast_elements(&[&ba, &bb]);
    let output = batch.saturating_mul(m).saturating_mul(n);
    Some((output.saturating_mul(k), output))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_256_matmul_and_its_backward_are_the_largest_products_in_place() {
        let square = [256_i64, 256];
        let forward = Work::of_op("matmul", &[&square, &square]).expect("a product");
        assert_eq!(forward.multiply_adds, 1 << 24);
        assert!(forward.runs_in_place());
        // Its backward through a shallow graph: the product's node and the
        // two leaves' accumulations.
        assert!(Work::of_backward(3, 1, 256 * 256).runs_in_place());
        assert!(!Work::of_backward(3, 2, 256 * 256).runs_in_place());
        let wider = [256_i64, 512];
        assert!(
            !Work::of_op("mm", &[&wider, &[512, 512]])
                .unwrap()
                .runs_in_place()
        );
    }

    #[test]
    fn products_count_by_matmuls_rules() {
        let work = |op: &str, shapes: &[&[i64]]| Work::of_op(op, shapes).map(|w| w.multiply_adds);
        assert_eq!(work("mm", &[&[2, 3], &[3, 4]]), Some(24));
        assert_eq!(work("mv", &[&[2, 3], &[3]]), Some(6));
        assert_eq!(work("dot", &[&[5], &[5]]), Some(5));
        assert_eq!(work("matmul", &[&[3], &[3, 4]]), Some(12));
        assert_eq!(work("bmm", &[&[7, 2, 3], &[7, 3, 4]]), Some(7 * 24));
        // Batches broadcast: a 2-D operand meets every batch of the other.
        assert_eq!(work("matmul", &[&[5, 1, 2, 3], &[6, 3, 4]]), Some(30 * 24));
        assert_eq!(work("addmm", &[&[4], &[2, 3], &[3, 4]]), Some(24));
        // Shapes that fit no product are the op's to refuse, on the pool.
        assert_eq!(work("mm", &[&[2, 3]]), None);
        assert_eq!(work("dot", &[&[], &[3]]), None);
    }

    #[test]
    fn an_outer_product_counts_its_output() {
        // 65536 x 1 by 1 x 65536: few multiply-adds, 4G elements written.
        let column = [65536_i64, 1];
        let row = [1_i64, 65536];
        let work = Work::of_op("mm", &[&column, &row]).expect("a product");
        assert_eq!(work.elements, 1 << 32);
        assert!(!work.runs_in_place());
    }

    #[test]
    fn broadcasting_counts_the_broadcast_shape() {
        let column = [512_i64, 1];
        let row = [1_i64, 512];
        let work = Work::of_op("add", &[&column, &row]).expect("elementwise");
        assert_eq!(work.elements, 512 * 512);
        assert!(work.runs_in_place());
        let column = [513_i64, 1];
        assert!(
            !Work::of_op("add", &[&column, &row])
                .unwrap()
                .runs_in_place()
        );
        // A reduction reads its input.
        assert_eq!(Work::of_op("sum", &[&[3, 4]]).unwrap().elements, 12);
    }

    #[test]
    fn backward_nodes_are_known_by_their_op() {
        assert_eq!(backward_node_kind("MmBackward0"), Some(NodeKind::Product));
        assert_eq!(
            backward_node_kind("AddmmBackward0"),
            Some(NodeKind::Product)
        );
        assert_eq!(backward_node_kind("SumBackward1"), Some(NodeKind::Bounded));
        assert_eq!(backward_node_kind("TBackward0"), Some(NodeKind::Bounded));
        assert_eq!(
            backward_node_kind("torch::autograd::AccumulateGrad"),
            Some(NodeKind::Bounded)
        );
        // Work its tensors do not bound, or an op we do not know.
        assert_eq!(backward_node_kind("ConvolutionBackward0"), None);
        assert_eq!(backward_node_kind("RepeatBackward0"), None);
        assert_eq!(
            backward_node_kind("torch::distributed::autograd::RecvRpcBackward"),
            None
        );
    }
}
