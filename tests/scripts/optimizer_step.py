"""broadcast_parameters + one DistributedOptimizer SGD step on different data per rank.

Writes, per rank, to OUT_DIR/result.<rank>.json (usage: optimizer_step.py OUT_DIR): the weights after broadcast,
this rank's own (local) gradient and the weights after the step. The test checks the arithmetic: every rank ends
with w0 - lr * mean(local gradients).
"""

import json
import os
import sys

import horovod.torch as hvd
import torch

LR = 0.1
hvd.init()
rank = hvd.rank()
torch.manual_seed(1234 + rank)  # deliberately different initial weights per rank
model = torch.nn.Linear(4, 1).double()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
w0 = [p.detach().clone() for p in model.parameters()]

gen = torch.Generator().manual_seed(99 + rank)  # different data per rank
x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
y = torch.randn(8, 1, generator=gen, dtype=torch.float64)
loss = torch.nn.functional.mse_loss(model(x), y)
local_grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)

opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters())
hvd.broadcast_optimizer_state(opt, root_rank=0)
opt.zero_grad()
loss.backward()
opt.step()

result = {
    "rank": rank,
    "lr": LR,
    "w0": [t.flatten().tolist() for t in w0],
    "local_grad": [g.flatten().tolist() for g in local_grads],
    "w1": [p.detach().flatten().tolist() for p in model.parameters()],
}
tmp = os.path.join(sys.argv[1], f".result.{rank}.tmp")
with open(tmp, "w") as f:
    json.dump(result, f)
os.replace(tmp, os.path.join(sys.argv[1], f"result.{rank}.json"))
