"""Jobs across nodes: the plan prices axes that span nodes on the inter-node link, and torchrun runs them.

Two torchrun agents on this machine pose as two nodes (``--nnodes 2``, 2 ranks
each, c10d rendezvous): ``autopar run`` trains a compiled model on a (node, tp)
mesh, checks it against one device, saves every step, and a second job of two
agents resumes from the checkpoint and passes the check against the
uninterrupted run.  The pricing is checked without ranks: with 2 ranks per node
the axis that spans nodes costs what the profile's inter-node link says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import PARTITIONING_PROFILE

import autopar
from autopar.runtime.spawn import free_port
from costmodel import collective_time_s, load_profile


def _two_link_profile(tmp_path: Path) -> str:
    """The test profile with an inter-node link 20x slower than its intra-node one."""
    text = Path(PARTITIONING_PROFILE).read_text()
    head, inter = text.split("[inter_node]")
    inter = re.sub(r"bandwidth_bytes_per_s = .*", "bandwidth_bytes_per_s = 1e8", inter)
    inter = re.sub(r'name = ".*"', 'name = "slow-nic"', inter, count=1)
    path = tmp_path / "two_links.toml"
    path.write_text(head + "[inter_node]" + inter)
    return str(path)


def test_an_axis_that_spans_nodes_is_priced_on_the_inter_node_link_and_the_search_avoids_it(tmp_path):
    from autopar.models import load_model
    from autopar.planner import plan_from_context, prepare

    profile_path = _two_link_profile(tmp_path)
    profile = load_profile(profile_path)
    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16)

    def context(mesh, per_node):
        return prepare(
            model, mesh, example_inputs=args, example_kwargs=kwargs, profile=profile_path, devices_per_node=per_node
        )

    def dp_plan(mesh, per_node):
        return plan_from_context(context(mesh, per_node), family="data parallel", compare_families=False)

    mesh = autopar.Mesh((2, 2), axis_names=("node", "tp"))
    assert [link.name for link in context(mesh, 2).coster.links] == ["slow-nic", "gloo-loopback"]
    assert [link.name for link in context(mesh, None).coster.links] == ["gloo-loopback", "gloo-loopback"]
    # on one node the batch is split over both axes (the gradients reduced by one all-reduce over both, flattened);
    # across two nodes of 2 ranks the search keeps the gradient all-reduces off the slow axis, and what it still
    # sends there costs the slow link's price
    one_node, two_nodes = dp_plan(mesh, None), dp_plan(mesh, 2)
    assert one_node.settings.devices_per_node is None and two_nodes.settings.devices_per_node == 2
    assert one_node.flat_grad_axes == (("node", "tp"),)
    assert any(c.axis == "node+tp" and c.kind == "all_reduce" for c in one_node.collectives)
    on_node = [c for c in two_nodes.collectives if "node" in c.axis.split("+")]
    assert two_nodes.collectives and not any(c.kind == "all_reduce" for c in on_node)
    for c in on_node:
        assert c.time_s >= collective_time_s(c.kind, c.bytes, 2, profile.inter_node)
    assert "crosses nodes" not in one_node.table()
    assert "nodes of 2 rank(s): axis node crosses nodes (slow-nic link), tp stays within a node" in two_nodes.table()
    with pytest.raises(ValueError, match="devices_per_node 0: expected an int >= 1"):
        prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=profile_path, devices_per_node=0)


def _two_agents(flags: list[str], timeout_s: float = 420) -> str:
    """Start two torchrun agents of 2 ranks each (c10d rendezvous on loopback); both must exit 0; their output."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"autopar-{port}",
        "-m", "autopar.cli", "run", "gpt2-tiny", "--mesh", "2x2", "--axis-names", "node,tp",
        "--batch", "4", "--seq", "16", *flags,
    ]  # fmt: skip
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for _ in range(2)]  # fmt: skip
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=timeout_s)
            outputs.append(out)
    finally:
        for agent in agents:
            agent.kill()
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out
    return "\n".join(outputs)


def test_two_torchrun_agents_posing_as_nodes_train_save_and_resume_like_one_device(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _two_agents(["--steps", "2", "--check", "--family", "tensor-parallel", "--save", str(ckpt),
                       "--save-every", "1"])  # fmt: skip
    assert "4 ranks (torchrun, gloo)" in out and "check: PASS" in out, out
    assert "axis node crosses nodes" in out, out  # torchrun's LOCAL_WORLD_SIZE: 2 ranks per node
    assert sorted(os.listdir(ckpt)) == ["step-1", "step-2"]
    out = _two_agents(["--steps", "3", "--check", "--family", "tensor-parallel", "--resume", str(ckpt)])
    assert f"resumed from {ckpt}/step-2 with 2 steps done" in out and "check: PASS" in out, out
