//! Send and recv records, the walk that finds what a local graph reaches,
//! graph inspection ([`Node`]) and the gradients of a context
//! ([`Gradients`]).

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tch::Tensor;
use wasmrpc_torch_sys::GradFn;

use super::context::ContextInner;
use crate::ops::placement::{NodeKind, backward_node_kind};
use crate::tensor::impl_id;

/// The name of an `AccumulateGrad` node, as libtorch reports it.
pub const ACCUMULATE_GRAD_NAME: &str = "torch::autograd::AccumulateGrad";
/// The name a recv record's node has in PyTorch.
pub const RECV_RPC_BACKWARD_NAME: &str = "torch::distributed::autograd::RecvRpcBackward";
/// The name a send record's node has in PyTorch.
pub const SEND_RPC_BACKWARD_NAME: &str = "torch::distributed::autograd::SendRpcBackward";

/// Tensors shared between threads: `tch::Tensor` is `Send` but not
/// `Sync`, so shared records keep theirs behind a lock and hand out
/// handles.
#[derive(Default)]
pub(crate) struct Tensors(Mutex<Vec<Tensor>>);

impl Tensors {
    pub(crate) fn new(tensors: Vec<Tensor>) -> Self {
        Tensors(Mutex::new(tensors))
    }

    /// Handles to the tensors (`shallow_clone`s).
    pub(crate) fn get(&self) -> Vec<Tensor> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(Tensor::shallow_clone)
            .collect()
    }
}

/// Where the local graph is cut: the leaves of a recv record, or the
/// outputs of a custom function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum CutPoint {
    Recv(i64),
    Custom(i64),
}

/// What the graph behind some tensors reaches: the leaves to ask gradients
/// for, and the cuts among them.
pub(crate) struct Reachable {
    pub(crate) leaves: Tensors,
    pub(crate) cuts: BTreeSet<CutPoint>,
    /// How many autograd nodes the walk visited.
    pub(crate) nodes: usize,
    /// The largest element count among the outputs and leaves.
    pub(crate) max_elements: i64,
    /// How many of the nodes are the backward of a product (`mm`, ...).
    products: usize,
    /// Whether every node is the backward of an op whose work its tensors
    /// bound, or a gradient's accumulation (`placement::backward_node_kind`).
    bounded: bool,
    /// Whether every node's inputs and outputs are among the outputs and
    /// leaves (no node feeds another): then `max_elements` bounds every
    /// tensor the pass touches.
    shallow: bool,
}

impl Reachable {
    /// Whether backward through this piece may run on the calling runtime
    /// thread instead of the blocking pool (OPS-1, `ops::placement`): a
    /// few nodes over small tensors at any depth, or a shallow graph of
    /// bounded nodes whose work the tensors keep within the bounds.
    pub(crate) fn is_cheap(&self) -> bool {
        use crate::ops::placement::{SMALL_ELEMENTS, SMALL_GRAPH_NODES, Work};
        let max_elements = u64::try_from(self.max_elements).unwrap_or(0);
        if self.nodes <= SMALL_GRAPH_NODES && max_elements <= SMALL_ELEMENTS {
            return true;
        }
        self.shallow
            && self.bounded
            && Work::of_backward(self.nodes, self.products, max_elements).runs_in_place()
    }
}

/// Walks the graph behind `outputs` down to its leaves; `cut_of` tells
/// which leaves are cuts.
pub(crate) fn walk(outputs: &[Tensor], cut_of: &dyn Fn(usize) -> Option<CutPoint>) -> Reachable {
    let mut leaves = Vec::new();
    let mut cuts = BTreeSet::new();
    let mut seen_leaves = HashSet::new();
    let mut seen_nodes = HashSet::new();
    let mut stack: Vec<GradFn> = Vec::new();
    let mut leaf = |t: Tensor, leaves: &mut Vec<Tensor>, cuts: &mut BTreeSet<CutPoint>| {
        let id = impl_id(&t);
        if !seen_leaves.insert(id) {
            return;
        }
        if let Some(c) = cut_of(id) {
            cuts.insert(c);
        }
        leaves.push(t);
    };
    let mut max_elements = 0;
    for t in outputs {
        max_elements = max_elements.max(element_count(t));
        let id = impl_id(t);
        if cut_of(id).is_some() {
            leaf(t.shallow_clone(), &mut leaves, &mut cuts);
        } else if let Some(g) = GradFn::of(t) {
            if seen_nodes.insert(g.id()) {
                stack.push(g);
            }
        } else if t.requires_grad() {
            leaf(t.shallow_clone(), &mut leaves, &mut cuts);
        }
    }
    let (mut products, mut bounded, mut shallow) = (0, true, true);
    while let Some(node) = stack.pop() {
        match backward_node_kind(&node.name()) {
            Some(NodeKind::Product) => products += 1,
            Some(NodeKind::Bounded) => {}
            None => bounded = false,
        }
        for (next, _) in node.next_functions() {
            let Some(next) = next else { continue };
            if !seen_nodes.insert(next.id()) {
                continue;
            }
            if let Some(v) = next.variable() {
                leaf(v, &mut leaves, &mut cuts);
            } else {
                shallow = false;
                stack.push(next);
            }
        }
    }
    let max_elements = leaves
        .iter()
        .map(element_count)
        .fold(max_elements, i64::max);
    Reachable {
        leaves: Tensors::new(leaves),
        cuts,
        nodes: seen_nodes.len(),
        max_elements,
        products,
        bounded,
        shallow,
    }
}

fn element_count(t: &Tensor) -> i64 {
    if t.defined() {
        t.size().iter().product()
    } else {
        0
    }
}

pub(crate) struct SendInner {
    pub(crate) message_id: i64,
    pub(crate) to: u32,
    pub(crate) tensors: Tensors,
    pub(crate) reach: OnceLock<Arc<Reachable>>,
    ctx: Weak<ContextInner>,
}

/// A send record (PyTorch's `SendRpcBackward`): the tensors that required
/// grad in one message this worker sent inside a context. Gradients for
/// them come back from the worker that received them.
#[derive(Clone)]
pub struct SendFunction {
    pub(crate) inner: Arc<SendInner>,
}

impl std::fmt::Debug for SendFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendFunction")
            .field("message_id", &self.inner.message_id)
            .field("to", &self.inner.to)
            .finish()
    }
}

impl SendFunction {
    pub(crate) fn new(
        message_id: i64,
        to: u32,
        tensors: Vec<Tensor>,
        ctx: Weak<ContextInner>,
    ) -> Self {
        SendFunction {
            inner: Arc::new(SendInner {
                message_id,
                to,
                tensors: Tensors::new(tensors),
                reach: OnceLock::new(),
                ctx,
            }),
        }
    }

    /// The autograd message id.
    pub fn message_id(&self) -> i64 {
        self.inner.message_id
    }

    /// The rank the message went to.
    pub fn to_worker(&self) -> u32 {
        self.inner.to
    }

    /// The tensors sent that required grad, in message order.
    pub fn tensors(&self) -> Vec<Tensor> {
        self.inner.tensors.get()
    }

    /// [`SEND_RPC_BACKWARD_NAME`].
    pub fn name(&self) -> &'static str {
        SEND_RPC_BACKWARD_NAME
    }

    /// Python's `next_functions`: one edge per tensor sent that required
    /// grad, to the node that produced it (an `AccumulateGrad` for a leaf, a
    /// recv record for a tensor received in the context).
    pub fn next_functions(&self) -> Vec<(Node, u32)> {
        self.inner
            .tensors
            .get()
            .iter()
            .filter_map(|t| node_of(t, &self.inner.ctx))
            .collect()
    }
}

/// The node `t`'s gradient flows to, and which of its inputs.
fn node_of(t: &Tensor, ctx: &Weak<ContextInner>) -> Option<(Node, u32)> {
    if let Some(recv) = recv_of(t, ctx) {
        return Some((Node::recv(recv), 0));
    }
    if let Some(g) = GradFn::of(t) {
        return Some((Node::autograd(g, ctx.clone()), 0));
    }
    // A leaf: its AccumulateGrad, reached through a throwaway alias (a
    // product for sparse tensors, which have no alias).
    let probe = if t.is_sparse() {
        t.f_mul_scalar(1).ok()?
    } else {
        t.f_alias().ok()?
    };
    let (g, nr) = GradFn::of(&probe)?.next_functions().into_iter().next()?;
    Some((Node::autograd(g?, ctx.clone()), nr))
}

fn recv_of(t: &Tensor, ctx: &Weak<ContextInner>) -> Option<RecvFunction> {
    let ctx = ctx.upgrade()?;
    let st = ctx.state.lock().unwrap_or_else(|p| p.into_inner());
    match st.cut_leaves.get(&impl_id(t)) {
        Some(CutPoint::Recv(m)) => st.recvs.get(m).cloned(),
        _ => None,
    }
}

pub(crate) struct RecvInner {
    pub(crate) message_id: i64,
    pub(crate) from: u32,
    /// The device map the gradients travel back with: the inverse of the
    /// map the received message came with.
    pub(crate) grads_map: crate::device::MapDirection,
    pub(crate) leaves: Tensors,
}

/// A recv record (PyTorch's `RecvRpcBackward`): the tensors that required
/// grad in one message this worker received inside a context. Their
/// gradients are sent back to the sender.
#[derive(Clone)]
pub struct RecvFunction {
    pub(crate) inner: Arc<RecvInner>,
}

impl std::fmt::Debug for RecvFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvFunction")
            .field("message_id", &self.inner.message_id)
            .field("from", &self.inner.from)
            .finish()
    }
}

impl PartialEq for RecvFunction {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl RecvFunction {
    pub(crate) fn new(
        message_id: i64,
        from: u32,
        grads_map: crate::device::MapDirection,
        leaves: Vec<Tensor>,
    ) -> Self {
        RecvFunction {
            inner: Arc::new(RecvInner {
                message_id,
                from,
                grads_map,
                leaves: Tensors::new(leaves),
            }),
        }
    }

    /// The autograd message id.
    pub fn message_id(&self) -> i64 {
        self.inner.message_id
    }

    /// The rank the message came from.
    pub fn from_worker(&self) -> u32 {
        self.inner.from
    }

    /// The received tensors that require grad.
    pub fn tensors(&self) -> Vec<Tensor> {
        self.inner.leaves.get()
    }

    /// [`RECV_RPC_BACKWARD_NAME`].
    pub fn name(&self) -> &'static str {
        RECV_RPC_BACKWARD_NAME
    }
}

/// A node of the autograd graph as a context sees it (Python's
/// `grad_fn` objects): libtorch's own node (`AddBackward0`,
/// `AccumulateGrad`, ...), or a recv record standing where a received
/// tensor's `AccumulateGrad` is. Two nodes are equal when they are the same
/// node.
#[derive(Clone)]
pub struct Node {
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    Autograd {
        node: Arc<Mutex<GradFn>>,
        ctx: Weak<ContextInner>,
    },
    Recv(RecvFunction),
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl PartialEq for Node {
    fn eq(&self, other: &Self) -> bool {
        match (&self.repr, &other.repr) {
            (Repr::Autograd { node: a, .. }, Repr::Autograd { node: b, .. }) => {
                lock_node(a).id() == lock_node(b).id()
            }
            (Repr::Recv(a), Repr::Recv(b)) => a == b,
            _ => false,
        }
    }
}

fn lock_node(n: &Mutex<GradFn>) -> std::sync::MutexGuard<'_, GradFn> {
    n.lock().unwrap_or_else(|p| p.into_inner())
}

impl Node {
    pub(crate) fn autograd(node: GradFn, ctx: Weak<ContextInner>) -> Node {
        Node {
            repr: Repr::Autograd {
                node: Arc::new(Mutex::new(node)),
                ctx,
            },
        }
    }

    pub(crate) fn recv(recv: RecvFunction) -> Node {
        Node {
            repr: Repr::Recv(recv),
        }
    }

    /// The recv record this node stands for, if it is one.
    pub fn as_recv(&self) -> Option<&RecvFunction> {
        match &self.repr {
            Repr::Recv(r) => Some(r),
            Repr::Autograd { .. } => None,
        }
    }

    /// The node's name (Python's `.name()`).
    pub fn name(&self) -> String {
        match &self.repr {
            Repr::Autograd { node, .. } => lock_node(node).name(),
            Repr::Recv(r) => r.name().to_string(),
        }
    }

    /// Python's `next_functions`; a received tensor's `AccumulateGrad`
    /// appears as its recv record.
    pub fn next_functions(&self) -> Vec<(Option<Node>, u32)> {
        let Repr::Autograd { node, ctx } = &self.repr else {
            return Vec::new();
        };
        let next = lock_node(node).next_functions();
        next.into_iter()
            .map(|(next, nr)| {
                let next = next.map(|g| {
                    let recv = g.variable().and_then(|v| recv_of(&v, ctx));
                    match recv {
                        Some(r) => Node::recv(r),
                        None => Node::autograd(g, ctx.clone()),
                    }
                });
                (next, nr)
            })
            .collect()
    }

    /// `t.grad_fn`: the node that produced `t`, none for a leaf.
    pub fn grad_fn(t: &Tensor) -> Option<Node> {
        GradFn::of(t).map(|g| Node::autograd(g, Weak::new()))
    }

    /// `node.register_hook(f)` on an `AccumulateGrad` (a post hook,
    /// `f(output_grads, input_grads)`; see `post_hook`): it runs each time a
    /// distributed backward pass computes the leaf's gradient.
    ///
    /// # Errors
    /// `RuntimeError` for any other node.
    pub fn register_hook(
        &self,
        f: impl Fn(&[Option<Tensor>], &[Option<Tensor>]) -> crate::Result<()> + Send + Sync + 'static,
    ) -> crate::Result<super::PostHookHandle> {
        let Some(leaf) = self.variable() else {
            return Err(crate::Error::runtime(format!(
                "post hooks run on {ACCUMULATE_GRAD_NAME} nodes only, not on {}",
                self.name()
            )));
        };
        Ok(super::post_hook::register(leaf, Arc::new(f)))
    }

    /// For an `AccumulateGrad`, the leaf it accumulates into (`.variable`).
    pub fn variable(&self) -> Option<Tensor> {
        match &self.repr {
            Repr::Autograd { node, .. } => lock_node(node).variable(),
            Repr::Recv(_) => None,
        }
    }
}

/// The gradients a context accumulated on this worker (`get_gradients`),
/// keyed by tensor identity: look a tensor up with [`get`](Self::get).
#[derive(Default)]
pub struct Gradients {
    entries: Vec<(Tensor, Tensor)>,
}

impl std::fmt::Debug for Gradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(k, v)| (k.size(), v.size())))
            .finish()
    }
}

impl Gradients {
    pub(crate) fn new(entries: Vec<(Tensor, Tensor)>) -> Self {
        Gradients { entries }
    }

    /// The gradient of `tensor` (the same tensor object, not an equal one).
    pub fn get(&self, tensor: &Tensor) -> Option<Tensor> {
        let id = impl_id(tensor);
        self.entries
            .iter()
            .find(|(k, _)| impl_id(k) == id)
            .map(|(_, g)| g.shallow_clone())
    }

    /// Whether `tensor` has a gradient.
    pub fn contains(&self, tensor: &Tensor) -> bool {
        self.get(tensor).is_some()
    }

    /// How many tensors have a gradient.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no tensor has a gradient.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every (tensor, gradient) pair.
    pub fn iter(&self) -> impl Iterator<Item = (&Tensor, &Tensor)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn leaf(side: i64) -> Tensor {
        Tensor::rand([side, side], (Kind::Float, Device::Cpu)).set_requires_grad(true)
    }

    fn reach(outputs: &[Tensor]) -> Reachable {
        walk(outputs, &|_| None)
    }

    /// The pieces of the bench's 256x256 step: the callee's matmul over
    /// the leaves it received, the caller's sum over the product it
    /// received. Both run in place (OPS-1).
    #[test]
    fn a_256_matmul_or_a_sum_over_leaves_runs_its_backward_in_place() {
        let (a, b) = (leaf(256), leaf(256));
        let product = reach(&[a.matmul(&b)]);
        assert_eq!(product.nodes, 3, "the product's node and two accumulations");
        assert_eq!(product.products, 1);
        assert!(product.shallow && product.bounded);
        assert!(product.is_cheap());
        assert!(reach(&[a.sum(None)]).is_cheap());
    }

    #[test]
    fn larger_products_deep_graphs_and_unknown_nodes_go_to_the_pool() {
        let (a, b) = (leaf(512), leaf(512));
        assert!(!reach(&[a.matmul(&b)]).is_cheap(), "512³ multiply-adds");
        // A sum over a product hides the product's output from the walk.
        let (a, b) = (leaf(256), leaf(256));
        let deep = reach(&[a.matmul(&b).sum(None)]);
        assert!(!deep.shallow);
        assert!(!deep.is_cheap());
        let repeated = reach(&[a.repeat([2, 1])]);
        assert!(
            !repeated.bounded,
            "repeat's work is not bounded by its input"
        );
        assert!(!repeated.is_cheap());
        // Small tensors: cheap at any depth and any node.
        let (a, b) = (leaf(32), leaf(32));
        assert!(reach(&[a.matmul(&b).relu().sum(None)]).is_cheap());
    }
}
