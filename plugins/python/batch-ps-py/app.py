"""A batching parameter server, written as a PyTorch user writes one.

The server holds a ResNet and an SGD optimizer. Each trainer computes the
gradients of its own batch on its copy of the model and reports them;
the server adds them up and, once every trainer of the round has
reported, applies their mean in one step and answers every trainer with
the updated model. This is the pattern of PyTorch's batch RPC example
(`distributed/rpc/batch/parameter_server.py`): an `async_execution`
function whose future the round's last report completes, an RRef to an
object made in place (`rpc.RRef(BatchingServer(...))`), a model returned
by value, and `run` waiting for the trainers while their reports reach
the object in its own instance.

    wasmrpc launch --names server,trainer1,trainer2 \\
        --plugins target/wasm-plugins/python/batch_ps_py.wasm \\
        --entry batch_ps_py::run --entry-on server \\
        --entry-json '[["trainer1", "trainer2"]]'

The result is each trainer's loss at each step: every trainer learns its
own fixed batch, so its loss falls from round to round.
"""

import threading
from datetime import datetime

import wasmrpc
from wasmrpc import rpc, torch, torchvision
from wasmrpc.torch import nn, optim


def timed_log(text):
    print(f"{datetime.now().strftime('%H:%M:%S')} {text}")


class BatchingServer:
    def __init__(self, trainers, num_classes, lr):
        self.model = torchvision.models.resnet18(num_classes=num_classes)
        self.lock = threading.Lock()
        self.next_model = torch.futures.Future()
        self.trainers = trainers
        self.reported = 0
        self.steps = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    def steps_taken(self):
        return self.steps

    @staticmethod
    @rpc.functions.async_execution
    def report(server_rref, grads):
        self = server_rref.local_value()
        for p, g in zip(self.model.parameters(), grads):
            p.grad += g
        with self.lock:
            self.reported += 1
            fut = self.next_model
            if self.reported == self.trainers:
                for p in self.model.parameters():
                    p.grad /= self.trainers
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.reported = 0
                self.steps += 1
                fut.set_result(self.model)
                timed_log(f"server: step {self.steps}")
                self.next_model = torch.futures.Future()
        return fut


class Trainer:
    def __init__(self, server_rref, batch_size, num_classes, image_size):
        self.server_rref = server_rref
        self.loss_fn = nn.MSELoss()
        self.inputs = torch.randn(batch_size, 3, image_size, image_size)
        labels = torch.LongTensor(batch_size).random_(0, num_classes).view(batch_size, 1)
        self.targets = torch.zeros(batch_size, num_classes).scatter_(1, labels, 1)

    def train(self, steps):
        name = rpc.get_worker_info().name
        model = self.server_rref.rpc_sync().get_model()
        losses = []
        for step in range(steps):
            loss = self.loss_fn(model(self.inputs), self.targets)
            loss.backward()
            losses.append(loss.item())
            timed_log(f"{name}: step {step} loss {loss.item():.5f}")
            model = rpc.rpc_sync(
                self.server_rref.owner(),
                BatchingServer.report,
                args=(self.server_rref, [p.grad for p in model.parameters()]),
            )
        return losses


def run_trainer(server_rref, steps, batch_size, num_classes, image_size):
    trainer = Trainer(server_rref, batch_size, num_classes, image_size)
    return trainer.train(steps)


def run(trainers, steps=5, batch_size=8, num_classes=10, image_size=32, lr=0.01):
    """Trains with `trainers` (worker names) for `steps` rounds; returns
    each trainer's losses, by name."""
    timed_log("server: start")
    server_rref = rpc.RRef(BatchingServer(len(trainers), num_classes, lr))
    futs = [
        rpc.rpc_async(t, run_trainer, args=(server_rref, steps, batch_size, num_classes, image_size))
        for t in trainers
    ]
    losses = torch.futures.wait_all(futs)
    assert server_rref.rpc_sync().steps_taken() == steps
    timed_log("server: done")
    return dict(zip(trainers, losses))


# One instance per worker: the server object lives in it, and a call that
# waits (`run`, a trainer's `rpc_sync`) lets the others run meanwhile.
wasmrpc.single_instance()
wasmrpc.export_module(__name__)
