//! `tcp`: this crate's own CPU collective backend
//! (`init_process_group("tcp", ...)`). PyTorch's `gloo` is libtorch's
//! `ProcessGroupGloo` ([`crate::engine`]); this one is not Gloo and does not
//! use its name.
//!
//! Collectives run over the
//! crate's mesh (one TCP connection per pair of members, addresses
//! exchanged through the group's store). The algorithms are direct: every
//! contributor sends its data to every receiver, and each receiver combines
//! the contributions in rank order, so every rank computes a bit-identical
//! result. That costs `O(n²)` messages, which is right for the small worlds
//! this host runs and keeps the code easy to check.
//!
//! Tensors travel as raw bytes of their dtype (complex tensors as their real
//! view, bool as bytes); CUDA tensors are staged through host memory. The
//! address each member listens on is `127.0.0.1` unless
//! `WASMRPC_C10D_HOST` names another (multi-host groups need it).
//!
//! Connections are authenticated like the agent's, with the same
//! credentials (`wasmrpc-credentials`, from the operator only):
//! - with TLS credentials (`WASMRPC_TLS_CA`/`_CERT`/`_KEY`, or the `_PEM`
//!   variables `wasmrpc launch` sets, or [`TcpOptions::tls`]) every
//!   connection is TLS 1.3 with mutual authentication: each member presents
//!   its worker certificate, publishes the worker name it names beside its
//!   address, and a peer's certificate must name the worker published for
//!   the rank it claims (so a member cannot take another's rank, and a
//!   process without a certificate of the cluster CA cannot connect at
//!   all). Traffic is encrypted.
//! - with a cluster secret (`WASMRPC_CLUSTER_SECRET` or
//!   `WASMRPC_CLUSTER_SECRET_FILE`, or [`TcpOptions::secret`]) every
//!   connection opens with a mutual HMAC-SHA256 proof of it (inside TLS
//!   when both are given).
//! - with neither, members may listen on a loopback address only (or
//!   anywhere with `WASMRPC_C10D_INSECURE=1`).

use std::net::IpAddr;
use std::sync::Arc;

use tch::Tensor;
use wasmrpc_credentials::{TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV};

use crate::backend::{BackendArgs, CollectiveBackend, OpContext};
use crate::error::{Error, Result};
use crate::mesh::{Kind, Mesh, MeshAuth, MeshTls, Tag};
use crate::reduce_op::ReduceOp;

mod options;

pub use options::{FAILURE_TIMEOUT_ENV, TcpOptions};

/// The environment variable naming the address members listen on.
pub const HOST_ENV: &str = "WASMRPC_C10D_HOST";
/// The cluster secret, as the agent reads it (the value).
pub const SECRET_ENV: &str = wasmrpc_credentials::secret::SECRET_ENV;
/// The cluster secret, as the agent reads it (a file readable by its owner
/// only).
pub const SECRET_FILE_ENV: &str = wasmrpc_credentials::secret::SECRET_FILE_ENV;
/// Set to `1` to let members listen on a non-loopback address without a
/// secret (the agent's `--insecure`).
pub const INSECURE_ENV: &str = "WASMRPC_C10D_INSECURE";

/// The tcp backend of one group member.
#[derive(Debug)]
pub struct Tcp {
    rank: usize,
    size: usize,
    group: String,
    mesh: Mesh,
}

/// The constructor registered under [`crate::Backend::TCP`]:
/// [`create_with`] the options of [`TcpOptions::from_env`].
///
/// # Errors
/// As [`create_with`], and a secret file that cannot be used.
pub async fn create(args: BackendArgs) -> Result<Arc<dyn CollectiveBackend>> {
    create_with(args, TcpOptions::from_env()?).await
}

/// Connects this member to the others, each connection authenticated with
/// `opts.tls` and `opts.secret` when given.
///
/// # Errors
/// [`Error::Runtime`] for a non-loopback address without credentials (unless
/// `insecure`), store errors, and [`Error::Peer`] when the members cannot
/// connect and prove themselves within the group's timeout.
pub async fn create_with(
    args: BackendArgs,
    opts: TcpOptions,
) -> Result<Arc<dyn CollectiveBackend>> {
    let host = opts.host.unwrap_or_else(|| "127.0.0.1".to_owned());
    let loopback = host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if opts.secret.is_none() && opts.tls.is_none() && !loopback {
        if !opts.insecure {
            return Err(Error::Runtime(format!(
                "rank {} of group {}: the tcp backend would listen on {host} without a cluster \
                 secret or TLS credentials: every process that reaches it could take a rank's \
                 place. Give every rank TLS credentials ({TLS_CA_ENV}, {TLS_CERT_ENV}, \
                 {TLS_KEY_ENV}: `wasmrpc cert init` and `wasmrpc cert issue NAME`) or the same \
                 {SECRET_ENV} (or {SECRET_FILE_ENV}), or set {INSECURE_ENV}=1 to accept that",
                args.group_rank, args.group_name
            )));
        }
        tracing::warn!(
            rank = args.group_rank,
            group = %args.group_name,
            "c10d tcp: listening on {host} without credentials ({INSECURE_ENV}=1)"
        );
    }
    let tls = match &opts.tls {
        Some(creds) => {
            let refused = |e: wasmrpc_credentials::Error| {
                Error::Runtime(format!(
                    "rank {} of group {}: TLS credentials: {e}",
                    args.group_rank, args.group_name
                ))
            };
            Some(MeshTls {
                endpoints: creds.endpoints().map_err(refused)?,
                name: creds.worker_name().map_err(refused)?,
            })
        }
        None => None,
    };
    let mut mesh = Mesh::connect(
        &args.store,
        &host,
        MeshAuth {
            secret: opts.secret,
            tls,
        },
        args.group_rank,
        args.group_size,
        &args.group_name,
        args.timeout,
    )
    .await?;
    if let Some(window) = opts.failure_timeout {
        mesh.watch_liveness(window);
    }
    Ok(Arc::new(Tcp {
        rank: args.group_rank,
        size: args.group_size,
        group: args.group_name,
        mesh,
    }))
}

fn tag(ctx: &OpContext, step: usize) -> Tag {
    Tag {
        kind: Kind::Collective,
        seq: ctx.seq,
        sub: ctx.sub,
        step: step as u32,
    }
}

impl Tcp {
    fn err(&self, ctx: &OpContext, source: tch::TchError) -> Error {
        Error::Tensor {
            rank: self.rank,
            group: self.group.clone(),
            op: ctx.op.to_owned(),
            source,
        }
    }

    fn encode(&self, ctx: &OpContext, t: &Tensor) -> Result<Vec<u8>> {
        let n = t.numel();
        let mut buf = vec![0u8; n * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut buf, n)
            .map_err(|e| self.err(ctx, e))?;
        Ok(buf)
    }

    /// `bytes` as a host tensor of `like`'s shape and dtype.
    fn decode_like(&self, ctx: &OpContext, bytes: &[u8], like: &Tensor) -> Result<Tensor> {
        let want = like.numel() * like.kind().elt_size_in_bytes();
        if bytes.len() != want {
            return Err(Error::InvalidArgument(format!(
                "rank {} of group {}: {}: received {} bytes for a tensor of {want} bytes \
                 ({:?}, {:?}); tensor sizes differ across ranks",
                self.rank,
                self.group,
                ctx.op,
                bytes.len(),
                like.size(),
                like.kind()
            )));
        }
        Tensor::f_from_data_size(bytes, &like.size(), like.kind()).map_err(|e| self.err(ctx, e))
    }

    fn write(&self, ctx: &OpContext, dst: &mut Tensor, bytes: &[u8]) -> Result<()> {
        let src = self.decode_like(ctx, bytes, dst)?;
        dst.f_copy_(&src).map_err(|e| self.err(ctx, e))
    }

    async fn send_all(&self, ctx: &OpContext, step: usize, bytes: &[u8]) -> Result<()> {
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            self.mesh
                .send(ctx.op, peer, tag(ctx, step), bytes, ctx.timeout)
                .await?;
        }
        Ok(())
    }

    async fn recv_from(&self, ctx: &OpContext, peer: usize, step: usize) -> Result<Vec<u8>> {
        self.mesh
            .recv(ctx.op, peer, tag(ctx, step), ctx.timeout)
            .await
    }

    /// Combines the contributions of every rank (own bytes for this rank,
    /// received ones for the others) in rank order and writes the result
    /// into `dst`.
    async fn reduce_into(
        &self,
        ctx: &OpContext,
        step: usize,
        own: &[u8],
        dst: &mut Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let mut acc: Option<Tensor> = None;
        for r in 0..self.size {
            let bytes = if r == self.rank {
                own.to_vec()
            } else {
                self.recv_from(ctx, r, step).await?
            };
            let t = self.decode_like(ctx, &bytes, dst)?;
            let t = op.prepare(t).map_err(|e| self.err(ctx, e))?;
            acc = Some(match acc {
                None => t,
                Some(acc) => op.combine(&acc, &t).map_err(|e| self.err(ctx, e))?,
            });
        }
        if let Some(acc) = acc {
            let acc = op.finish(acc, self.size).map_err(|e| self.err(ctx, e))?;
            let acc = acc.f_to_kind(dst.kind()).map_err(|e| self.err(ctx, e))?;
            dst.f_copy_(&acc).map_err(|e| self.err(ctx, e))?;
        }
        Ok(())
    }

    /// Splits dim 0 of `t` into `split` rows per rank (equal parts if empty).
    fn split(&self, ctx: &OpContext, t: &Tensor, split: &[i64]) -> Result<Vec<Tensor>> {
        let sizes: Vec<i64> = if split.is_empty() {
            let rows = t.size().first().copied().unwrap_or(1);
            if rows % self.size as i64 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{}: dim 0 of size {rows} does not split into {} equal parts",
                    ctx.op, self.size
                )));
            }
            vec![rows / self.size as i64; self.size]
        } else {
            split.to_vec()
        };
        if sizes.len() != self.size {
            return Err(Error::InvalidArgument(format!(
                "{}: split sizes {sizes:?} do not name one part per rank of {}",
                ctx.op, self.size
            )));
        }
        t.f_split_with_sizes(&sizes, 0)
            .map_err(|e| self.err(ctx, e))
    }
}

#[async_trait::async_trait]
impl CollectiveBackend for Tcp {
    fn name(&self) -> String {
        crate::Backend::TCP.to_owned()
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    async fn broadcast(&self, ctx: &OpContext, tensors: Vec<Tensor>, root: usize) -> Result<()> {
        for (i, mut t) in tensors.into_iter().enumerate() {
            if self.rank == root {
                let bytes = self.encode(ctx, &t)?;
                self.send_all(ctx, i, &bytes).await?;
            } else {
                let bytes = self.recv_from(ctx, root, i).await?;
                self.write(ctx, &mut t, &bytes)?;
            }
        }
        Ok(())
    }

    async fn allreduce(&self, ctx: &OpContext, tensors: Vec<Tensor>, op: ReduceOp) -> Result<()> {
        for (i, mut t) in tensors.into_iter().enumerate() {
            let bytes = self.encode(ctx, &t)?;
            self.send_all(ctx, i, &bytes).await?;
            self.reduce_into(ctx, i, &bytes, &mut t, op).await?;
        }
        Ok(())
    }

    async fn reduce(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        for (i, mut t) in tensors.into_iter().enumerate() {
            let bytes = self.encode(ctx, &t)?;
            if self.rank == root {
                self.reduce_into(ctx, i, &bytes, &mut t, op).await?;
            } else {
                self.mesh
                    .send(ctx.op, root, tag(ctx, i), &bytes, ctx.timeout)
                    .await?;
            }
        }
        Ok(())
    }

    async fn allgather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        for (i, (outs, input)) in outputs.into_iter().zip(inputs).enumerate() {
            let bytes = self.encode(ctx, &input)?;
            self.send_all(ctx, i, &bytes).await?;
            for (r, mut out) in outs.into_iter().enumerate() {
                if r == self.rank {
                    self.write(ctx, &mut out, &bytes)?;
                } else {
                    let theirs = self.recv_from(ctx, r, i).await?;
                    self.write(ctx, &mut out, &theirs)?;
                }
            }
        }
        Ok(())
    }

    async fn gather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
        root: usize,
    ) -> Result<()> {
        for (i, input) in inputs.into_iter().enumerate() {
            let bytes = self.encode(ctx, &input)?;
            if self.rank != root {
                self.mesh
                    .send(ctx.op, root, tag(ctx, i), &bytes, ctx.timeout)
                    .await?;
                continue;
            }
            let outs = outputs
                .get(i)
                .map(|o| o.iter().map(Tensor::shallow_clone).collect::<Vec<_>>());
            for (r, mut out) in outs.unwrap_or_default().into_iter().enumerate() {
                let theirs = if r == self.rank {
                    bytes.clone()
                } else {
                    self.recv_from(ctx, r, i).await?
                };
                self.write(ctx, &mut out, &theirs)?;
            }
        }
        Ok(())
    }

    async fn scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        root: usize,
    ) -> Result<()> {
        for (i, mut out) in outputs.into_iter().enumerate() {
            if self.rank == root {
                let parts: Vec<Tensor> = inputs
                    .get(i)
                    .map(|p| p.iter().map(Tensor::shallow_clone).collect())
                    .unwrap_or_default();
                for (r, part) in parts.into_iter().enumerate() {
                    let bytes = self.encode(ctx, &part)?;
                    if r == self.rank {
                        self.write(ctx, &mut out, &bytes)?;
                    } else {
                        self.mesh
                            .send(ctx.op, r, tag(ctx, i), &bytes, ctx.timeout)
                            .await?;
                    }
                }
            } else {
                let bytes = self.recv_from(ctx, root, i).await?;
                self.write(ctx, &mut out, &bytes)?;
            }
        }
        Ok(())
    }

    async fn reduce_scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        op: ReduceOp,
    ) -> Result<()> {
        for (i, (mut out, parts)) in outputs.into_iter().zip(inputs).enumerate() {
            let mut own = Vec::new();
            for (r, part) in parts.into_iter().enumerate() {
                let bytes = self.encode(ctx, &part)?;
                if r == self.rank {
                    own = bytes;
                } else {
                    self.mesh
                        .send(ctx.op, r, tag(ctx, i), &bytes, ctx.timeout)
                        .await?;
                }
            }
            self.reduce_into(ctx, i, &own, &mut out, op).await?;
        }
        Ok(())
    }

    async fn alltoall_base(
        &self,
        ctx: &OpContext,
        output: Tensor,
        input: Tensor,
        output_split: Vec<i64>,
        input_split: Vec<i64>,
    ) -> Result<()> {
        let ins = self.split(ctx, &input, &input_split)?;
        let outs = self.split(ctx, &output, &output_split)?;
        self.alltoall(ctx, outs, ins).await
    }

    async fn alltoall(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        let mut own = Vec::new();
        for (r, input) in inputs.into_iter().enumerate() {
            let bytes = self.encode(ctx, &input)?;
            if r == self.rank {
                own = bytes;
            } else {
                self.mesh
                    .send(ctx.op, r, tag(ctx, 0), &bytes, ctx.timeout)
                    .await?;
            }
        }
        for (r, mut out) in outputs.into_iter().enumerate() {
            let bytes = if r == self.rank {
                std::mem::take(&mut own)
            } else {
                self.recv_from(ctx, r, 0).await?
            };
            self.write(ctx, &mut out, &bytes)?;
        }
        Ok(())
    }

    async fn barrier(&self, ctx: &OpContext) -> Result<()> {
        self.send_all(ctx, 0, &[]).await?;
        for r in (0..self.size).filter(|&r| r != self.rank) {
            self.recv_from(ctx, r, 0).await?;
        }
        Ok(())
    }

    async fn send(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        dst: usize,
        user_tag: u64,
    ) -> Result<()> {
        for (i, t) in tensors.into_iter().enumerate() {
            let bytes = self.encode(ctx, &t)?;
            let tag = Tag {
                kind: Kind::P2p,
                seq: user_tag,
                sub: 0,
                step: i as u32,
            };
            self.mesh
                .send(ctx.op, dst, tag, &bytes, ctx.timeout)
                .await?;
        }
        Ok(())
    }

    async fn recv(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        src: usize,
        user_tag: u64,
    ) -> Result<()> {
        for (i, mut t) in tensors.into_iter().enumerate() {
            let tag = Tag {
                kind: Kind::P2p,
                seq: user_tag,
                sub: 0,
                step: i as u32,
            };
            let bytes = self.mesh.recv(ctx.op, src, tag, ctx.timeout).await?;
            self.write(ctx, &mut t, &bytes)?;
        }
        Ok(())
    }

    fn shutdown(&self) {
        self.mesh.shut_down();
    }
}
