"""Two `dreamp2p node` daemons train a user's recipe: a ``[task] entry`` returning its own model, SGD with
momentum, a StepLR scheduler and a DataLoader, under ``[train]`` accumulation, clipping and bf16 autocast."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from dreamp2p.devtools.localrun import read_records, start_node, wait_exits, write_configs
from dreamp2p.service.checkpoint import list_checkpoints

ENTRY = textwrap.dedent(
    '''
    """A user's training recipe, as a package of theirs would ship it."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dreamp2p.service.recipe import Recipe

    LR, STEP_SIZE, GAMMA = 0.05, 8, 0.5


    def regression(seed, n):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        return x, x @ torch.linspace(-1.0, 1.0, 8).unsqueeze(1) + 0.2 * torch.sin(3 * x[:, :1])


    def make(cfg, rank, world, device):
        torch.manual_seed(cfg.seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=GAMMA)
        x, y = regression(100 + rank, 512)  # this node's shard
        loader = DataLoader(
            TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(rank)
        )
        ex, ey = regression(7, 256)

        def loss(m, batch):
            bx, by = batch
            return nn.functional.mse_loss(m(bx).float(), by)

        @torch.no_grad()
        def evaluate(m):
            return float(nn.functional.mse_loss(m(ex.to(device)), ey.to(device)))

        return Recipe(model, opt, loss, loader, scheduler=sched, evaluate=evaluate, tokens_per_batch=16)
    '''
)

PERIOD, MAX_DELAY = 4, 1
SYNC = {"strategy": "dreamddp", "period": PERIOD, "warmup_steps": 2, "control_every": 5, "max_delay": MAX_DELAY}
STEPS = 40
QUIET = PERIOD + MAX_DELAY + 1  # a whole period plus the longest delay at learning rate 0


NAMES = ("eu-west", "us-east")


def scheduled(step: int, final: int) -> float:
    """StepLR(0.05, step_size 8, gamma 0.5) as the entry builds it; 0 in the quiet stretch before ``final``."""
    return 0.0 if step >= final - QUIET else 0.05 * 0.5 ** (step // 8)


def recipe_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int) -> list[Path]:
    """Two nodes' files training the user's entry (on the children's PYTHONPATH) under every [train] knob."""
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "my_recipe.py").write_text(ENTRY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "user"))
    task = {"entry": "my_recipe:make", "steps": steps, "eval_every": 10}
    configs = write_configs(tmp_path, 2, rate_Bps=20e6, delay_s=0.002, sync=SYNC, task=task, checkpoint_every=10)
    for path in configs:
        path.write_text(path.read_text() + '\n[train]\naccumulation = 2\ngrad_clip = 1.0\namp = "bf16"\n')
    return configs


def run_to_the_end(configs: list[Path], tmp_path: Path, resume: bool = False, quiet_steps: int = 0) -> None:
    procs = [start_node(c, resume=resume, quiet_steps=quiet_steps) for c in configs]
    try:
        wait_exits(dict(zip(NAMES, procs, strict=True)), tmp_path, 240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_daemons_train_a_users_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configs = recipe_configs(tmp_path, monkeypatch, STEPS)
    run_to_the_end(configs, tmp_path, quiet_steps=QUIET)
    digests = set()
    for name in NAMES:
        records = read_records(tmp_path, name)
        steps = [r for r in records if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(STEPS))
        # the scheduler acted once per step: the learning rate each step used follows the schedule
        assert [r["lr"] for r in steps] == pytest.approx([scheduled(s, STEPS) for s in range(STEPS)])
        evals = [r["eval_loss"] for r in records if r["kind"] == "eval"]
        assert evals[-1] < 0.5 * evals[0], evals
        assert steps[0]["tokens_per_s"] > 0  # 2 micro-batches of 16 per step
        stop = [r for r in records if r["kind"] == "stop"][-1]
        assert stop["step"] == STEPS
        digests.add(stop["digest"])
        # the checkpoint carries the scheduler at the end of the run (never the quiet stretch's 0)
        ckpt = list_checkpoints(tmp_path / name / "checkpoints")[-1]
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        assert state["scheduler"]["last_epoch"] == STEPS
        assert state["sync"]["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05 * 0.5 ** (STEPS // 8))
    assert len(digests) == 1  # after the quiet stretch every replica holds the same parameters


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resumed_recipe_continues_its_schedule_and_its_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both nodes run half the steps and stop; restarted with --resume (and the full step count) they go on
    from their checkpoint: the scheduler where it was saved, the DataLoader skipped to batch 2 x 20."""
    half = STEPS // 2
    configs = recipe_configs(tmp_path, monkeypatch, half)
    run_to_the_end(configs, tmp_path)
    for path in configs:
        text = path.read_text()
        assert text.count(f"\nsteps = {half}\n") == 1
        path.write_text(text.replace(f"\nsteps = {half}\n", f"\nsteps = {STEPS}\n"))
    run_to_the_end(configs, tmp_path, resume=True, quiet_steps=QUIET)
    digests = set()
    for name in NAMES:
        records = read_records(tmp_path, name)
        first_stop, stop = [r for r in records if r["kind"] == "stop"]
        (resume,) = [r for r in records if r["kind"] == "resume"]
        assert resume["step"] == first_stop["step"] == half and resume["digest"] == first_stop["digest"]
        steps = [r for r in records if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(STEPS))
        assert [r["lr"] for r in steps] == pytest.approx(
            [scheduled(s, STEPS if s >= half else 10**9) for s in range(STEPS)]
        )
        assert "data: skipping 40 batches" in (tmp_path / f"{name}.log").read_text()  # 20 steps x 2 micro-batches
        digests.add(stop["digest"])
    assert len(digests) == 1
