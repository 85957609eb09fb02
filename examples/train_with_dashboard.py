"""Your own training loop with the dashboard beside it. Two lines are added (marked ADDED).

    python examples/train_with_dashboard.py            # then open the printed URL
    python examples/train_with_dashboard.py --help

The loop itself is plain PyTorch and stays unchanged: the inspector watches it through
real hooks on the model and the optimizer. When training ends the dashboard keeps
serving (`insp.wait()`) until Ctrl-C, so you can still look at the history and edit
hooks; history is also kept in ./gradient-inspector.sqlite (see `gradient-inspector replay`).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F

import inspector


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (another one needs a token)")
    parser.add_argument("--port", type=int, default=8000, help="dashboard port (default 8000; 0: any free)")
    parser.add_argument("--db", default=None, help="history file (default ./gradient-inspector.sqlite)")
    parser.add_argument(
        "--delay",
        type=float,
        default=0.02,
        help="seconds to sleep per step, so a person can follow (default 0.02)",
    )
    parser.add_argument("--no-wait", action="store_true", help="exit when training ends")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    insp = inspector.attach(model, optimizer)  # ADDED: real hooks on the model and the optimizer
    print("dashboard:", insp.serve(host=args.host, port=args.port, db=args.db), flush=True)  # ADDED

    for step in range(args.steps):
        x = torch.randn(64, 20)
        y = 2 * x[:, :1] + torch.sin(3 * x[:, 1:2])
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        insp.record(loss=loss)  # optional: the loss curve on the page
        if step % 500 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
        if args.delay:
            time.sleep(args.delay)

    print("training done", flush=True)
    if args.no_wait:
        insp.close()
    else:
        print("the dashboard keeps serving; Ctrl-C to quit", flush=True)
        insp.wait()  # serves until Ctrl-C, then closes


if __name__ == "__main__":
    main()
