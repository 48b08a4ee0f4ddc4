"""PyTorch's side of the CPU step benchmarks (train_step.py, cnn_step.py): one thread,
AdamW and cross-entropy on a fixed random batch, the median step time."""
import statistics
import time

import torch


def median_step_ms(model, batch, warmup, steps, lr=1e-3):
    """(median milliseconds of a forward + backward + AdamW step, the last loss)."""
    torch.set_num_threads(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.rand(batch, 784)
    y = torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), loss
