"""At interpreter exit the runtime finishes the loss collectives nobody read and drops its process groups while
Python is whole (``autopar.runtime.at_exit``): a script that trains, never reads its last loss and destroys the
default group exits cleanly, without hanging; a module used after the release says why it cannot run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from autopar.runtime import RankSettings, spawn_ranks

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.models import load_model

    dist.init_process_group("gloo")
    model, (ids,), kwargs = load_model("gpt2-tiny", batch=4, seq=16, device="cpu")
    sharded = autopar.compile(model, autopar.Mesh((2,)), example_inputs=(ids,), example_kwargs=kwargs)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    for step in range(2):
        loss = sharded(ids, **kwargs).loss  # never read: its collective is still pending at exit
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    print("trained", flush=True)
    """
)


def test_a_script_that_never_reads_its_last_loss_exits_cleanly(tmp_path):
    script = tmp_path / "train_unread.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count("trained") == 2, out
    assert "terminate called" not in out and "SIGABRT" not in out, out


def _rank_fn(rank, world):
    import autopar
    from autopar.models import load_model
    from autopar.runtime.at_exit import release

    model, (ids,), kwargs = load_model("gpt2-tiny", batch=4, seq=16, device="cpu")
    sharded = autopar.compile(model, autopar.Mesh((world,)), example_inputs=(ids,), example_kwargs=kwargs)
    loss = sharded(ids, **kwargs).loss
    loss.backward()
    release()  # what atexit runs: the pending loss is finished, the groups dropped
    value = float(loss)  # read after the release: the value the collective gave
    try:
        sharded(ids, **kwargs)
    except ValueError as e:
        return value, str(e)
    return value, None


def test_release_finishes_the_pending_loss_and_a_later_call_says_why_it_cannot_run():
    # fresh processes (not the tests' rank pool): the release drops every mesh of the process
    results = spawn_ranks(_rank_fn, 2, settings=RankSettings(timeout_s=300))[0]
    (v0, e0), (v1, e1) = results
    assert v0 == pytest.approx(v1) and v0 > 0
    for err in (e0, e1):
        assert err is not None and "the interpreter is exiting" in err and "compile the model again" in err
