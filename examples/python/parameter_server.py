"""The parameter server demo, driven by a Python program.

This process is the parameter server: it loads scikit-learn's digits with
numpy, keeps the model in `torch.nn`, and runs the training loop. The
trainers are `wasmrpc worker`s serving the sandboxed plugin
`mlp_loss_py::batch_loss` (`plugins/python/mlp-loss-py`): for each round,
every trainer computes the loss of the current parameters on its batch, in
one distributed autograd context; the driver sums the losses, runs the
backward pass across the group and steps a `DistributedOptimizer` over its
own parameters. Nothing but tensors crosses: no pickle, no Python code.

Run it (after `cargo xtask python`, in the torch venv), letting it start
three local trainers:

    .wasmrpc-env/venv/bin/python examples/python/parameter_server.py \\
        --spawn-trainers 3 --wasmrpc target/debug/wasmrpc \\
        --plugin target/wasm-plugins/python/mlp-loss-py.wasm

or start the trainers yourself (ranks 1..T of a group of T+1) and give
`--trainers T --init-method URL`. It prints each epoch's loss and held-out
accuracy (about 0.95 after 10 epochs, as the Rust demo) and, with
`--result FILE`, writes them as JSON.
"""

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn, optim

from wasmrpc import rpc
from wasmrpc.distributed import autograd as dist_autograd
from wasmrpc.distributed.optim import DistributedOptimizer

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "digits.csv.gz")


def load_digits(path):
    """`(train_x, train_y, test_x, test_y)`: every fifth image held out, as
    the Rust demo splits them; pixels scaled from 0..16 to 0..1."""
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images, labels = table[:, :64] / 16.0, table[:, 64].astype(np.int64)
    held_out = np.arange(len(labels)) % 5 == 4
    return (
        torch.from_numpy(images[~held_out]),
        torch.from_numpy(labels[~held_out]),
        torch.from_numpy(images[held_out]),
        torch.from_numpy(labels[held_out]),
    )


def spawn_trainers(wasmrpc, plugin, trainers, init_method):
    """Starts `trainers` local `wasmrpc worker`s (ranks 1..) serving the
    plugin."""
    procs = []
    for rank in range(1, trainers + 1):
        procs.append(
            subprocess.Popen(
                [
                    wasmrpc,
                    "worker",
                    "--name",
                    f"trainer{rank}",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(trainers + 1),
                    "--init-method",
                    init_method,
                    "--plugins",
                    plugin,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=3, help="trainer workers (ranks 1..T)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="images per trainer per round")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data", default=DATA, help="digits.csv.gz")
    parser.add_argument("--init-method", help="the group's rendezvous (default: a temporary file)")
    parser.add_argument("--spawn-trainers", type=int, metavar="T", help="start T local trainers")
    parser.add_argument("--wasmrpc", default="wasmrpc", help="the wasmrpc binary (with --spawn-trainers)")
    parser.add_argument("--plugin", help="mlp-loss-py.wasm (with --spawn-trainers)")
    parser.add_argument("--result", help="write the per-epoch results here as JSON")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_x, train_y, test_x, test_y = load_digits(args.data)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))

    trainers = args.spawn_trainers or args.trainers
    tmp = tempfile.TemporaryDirectory()
    init_method = args.init_method or f"file://{tmp.name}/rendezvous"
    procs = []
    if args.spawn_trainers:
        if not args.plugin:
            parser.error("--spawn-trainers needs --plugin (mlp-loss-py.wasm)")
        procs = spawn_trainers(args.wasmrpc, args.plugin, trainers, init_method)
    rpc.init_rpc(
        "ps",
        rank=0,
        world_size=trainers + 1,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method),
    )
    try:
        params = list(model.parameters())
        opt = DistributedOptimizer(optim.SGD, [rpc.RRef(p) for p in params], lr=args.lr)
        # Trainer k takes the training images j with j % T == k - 1, in
        # batches cut once: a batch that owns its storage is all that is
        # sent (a view would carry the storage it is cut from).
        shards = [(train_x[k::trainers], train_y[k::trainers]) for k in range(trainers)]
        rounds = -(-max(len(y) for _, y in shards) // args.batch_size)
        batches = [
            [
                (x[lo : lo + args.batch_size].clone(), y[lo : lo + args.batch_size].clone())
                for lo in range(0, len(y), args.batch_size)
            ]
            for x, y in shards
        ]
        history = []
        for epoch in range(1, args.epochs + 1):
            started, total, count = time.time(), 0.0, 0
            for b in range(rounds):
                with dist_autograd.context() as context_id:
                    futures = [
                        rpc.rpc_async(
                            f"trainer{k + 1}", "mlp_loss_py::batch_loss", args=(*params, *mine[b])
                        )
                        for k, mine in enumerate(batches)
                        if b < len(mine)
                    ]
                    losses = torch.futures.wait_all(futures)
                    loss = torch.stack(losses).sum()
                    dist_autograd.backward(context_id, [loss])
                    opt.step(context_id)
                total += loss.item() / len(losses)
                count += 1
            with torch.no_grad():
                logits = model(test_x)
                test_loss = nn.functional.cross_entropy(logits, test_y).item()
                accuracy = (logits.argmax(1) == test_y).float().mean().item()
            history.append(
                {"epoch": epoch, "train_loss": total / count, "test_loss": test_loss,
                 "test_accuracy": accuracy}
            )
            print(
                f"epoch {epoch}: train loss {total / count:.3f}, held-out loss {test_loss:.3f}, "
                f"accuracy {accuracy:.3f} ({time.time() - started:.1f} s)",
                flush=True,
            )
        if args.result:
            with open(args.result, "w") as f:
                json.dump(history, f, indent=2)
    finally:
        rpc.shutdown()
        for p in procs:
            p.wait(timeout=60)
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
