"""Distributed checkpoints (autopar/checkpoint/): each rank writes its own pieces, any layout loads them.

Truth comes from comparison: a checkpoint saved on a (2, 2) mesh under the auto
plan holds exactly the model's full tensors (read back with DCP's own
``dcp_to_torch_save``); every chunk on disk lies inside the piece of the rank
that wrote it; and training resumed from it on other meshes, under other plans
(a capped plan on 4 ranks, data parallel on 2) and in one process on the plain
``nn.Module`` ends where an uninterrupted single-device run ends: parameters,
AdamW state, step count and the learning-rate schedule.  Faults: a save killed
mid-write leaves the previous checkpoint loadable and the partial one rejected;
a checkpoint of another model fails naming the first mismatched key and both
shapes.
"""

from __future__ import annotations

import math
import os
import re
import signal

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, RankError, run_ranks
from test_execution import ADAMW, ATOL, RTOL, _model

import autopar
from autopar.checkpoint import CheckpointError, PieceTensor, piece_boxes
from autopar.pieces import coordinates, shard_tensor
from autopar.placement import Partial, Replicate, Shard

# ---- boxes: the pieces as DCP sees them ------------------------------------------------------------

LAYOUTS = [
    ((10, 6), (Shard(0), Shard(1)), (2, 2)),  # 2-D shards
    ((7, 5), (Shard(0),), (4,)),  # uneven: tensor_split sizes 2, 2, 2, 1
    ((3, 4), (Shard(0),), (4,)),  # a rank with an empty piece
    ((12, 6), (Shard(1, 3), Replicate()), (2, 2)),  # block-wise: three blocks per piece
    ((12, 8), (Shard(1, 2), Shard(1)), (2, 2)),  # block-wise on axis 0, nested plain shard on axis 1
    ((9,), (Replicate(), Shard(0)), (2, 3)),  # replicas on axis 0
    ((), (Replicate(),), (2,)),  # a scalar
    ((0, 4), (Shard(1),), (2,)),  # no elements
]


@pytest.mark.parametrize("shape,placements,mesh_shape", LAYOUTS, ids=[str(x) for x in LAYOUTS])
def test_boxes_tile_each_piece_and_cover_the_tensor_once_per_replica(shape, placements, mesh_shape):
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    replicas = math.prod(n for n, p in zip(mesh_shape, placements, strict=True) if not isinstance(p, Shard))
    covered = torch.zeros(shape, dtype=torch.int64)
    for coord in coordinates(mesh_shape):
        local = shard_tensor(full, placements, mesh_shape, coord)
        piece = PieceTensor.of(local, shape, placements, mesh_shape, coord)
        assert tuple(piece.shape) == shape and sum(math.prod(b.sizes) for b in piece.boxes) == local.numel()
        for b in piece.boxes:
            where = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))
            view = piece.box(b)
            assert torch.equal(view, full[where])
            assert view.numel() == 0 or view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            covered[where] += 1
    assert bool((covered == replicas).all()), covered


def test_a_piece_tensor_is_a_checkpoint_handle_not_a_tensor_to_compute_with():
    piece = PieceTensor.of(torch.ones(2, 3), (4, 3), (Shard(0),), (2,), (1,))
    assert "PieceTensor(shape=(4, 3)" in repr(piece)
    assert torch.equal(piece.detach().local, piece.local)
    with pytest.raises(NotImplementedError, match="compute on its .local piece"):
        piece + 1
    with pytest.raises(ValueError, match="partial value is not a piece"):
        piece_boxes((4,), (Partial(),), (2,), (0,))


# ---- saving on a mesh --------------------------------------------------------------------------------

STEPS = 2  # before the save, and again after the load
LR_DECAY = 0.5  # LambdaLR factor per step: the resumed runs must continue the schedule


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: LR_DECAY**step)


def _steps(module, opt, sched, args, kwargs, n):
    call = module if isinstance(module, autopar.ShardedModule) else (lambda *a, **k: module(*a, **k).to_tuple())
    for _ in range(n):
        if isinstance(module, autopar.ShardedModule) and module.plan.pipeline is not None:
            module.train_step(*args, **kwargs)  # forward and backward over the micro-batches
        else:
            call(*args, **kwargs)[0].backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _state_of(module, opt) -> dict:
    """Full parameters, AdamW moments and step per parameter, and the learning rate, as one device would hold them."""
    from autopar.checkpoint import OptimizerState

    full = module.full_state_dict() if isinstance(module, autopar.ShardedModule) else module.state_dict()
    moments = {}
    for fqn, values in OptimizerState(module, opt).state_dict()["state"].items():
        for k, v in values.items():
            if isinstance(v, PieceTensor):  # gather through the module's own path: full on every rank
                node, placement = module._param_state[fqn]
                v = module._gathered(v.local, placement, node.outputs[0].shape)
            moments[f"{fqn}.{k}"] = v.detach().clone()
    return {
        "params": {k: v.detach().clone() for k, v in full.items()},
        "moments": moments,
        "lr": opt.param_groups[0]["lr"],
    }


# GPT-2's fused q, k, v weight split block-wise on tp (each rank holds whole heads of q, of k and of v): the
# checkpoint must store block-wise pieces as the boxes they are
BLOCKWISE_QKV = {"transformer.h.*.attn.c_attn.weight": ["R", "S(1)[3]"]}


def _save_rank(rank, world, path):
    model, args, kwargs = _model("gpt2-tiny")
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
    sharded = autopar.compile(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        profile=PARTITIONING_PROFILE,
        hints=BLOCKWISE_QKV,
    )
    opt = torch.optim.AdamW(sharded.parameters(), **ADAMW)
    sched = _scheduler(opt)
    _steps(sharded, opt, sched, args, kwargs, STEPS)
    autopar.save(path, sharded, opt, extra={"scheduler": sched, "train": {"step": STEPS}})
    pieces = {k: (v.placements, tuple(v.local.shape)) for k, v in sharded.local_state().items()}
    return {"state": _state_of(sharded, opt), "family": sharded.plan.family, "pieces": pieces}


def _resume_rank(rank, world, path, mesh_shape, axis_names, options):
    model, args, kwargs = _model("gpt2-tiny")
    with torch.no_grad():
        for p in model.parameters():  # the load must overwrite every weight
            p.zero_()
    mesh = autopar.Mesh(mesh_shape, axis_names=axis_names)
    sharded = autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, **options
    )
    opt = torch.optim.AdamW(sharded.parameters(), **ADAMW)
    sched = _scheduler(opt)
    train = {"step": 0}
    autopar.load(path, sharded, opt, extra={"scheduler": sched, "train": train})
    resumed_lr = opt.param_groups[0]["lr"]
    _steps(sharded, opt, sched, args, kwargs, STEPS)
    state = _state_of(sharded, opt)
    return {"state": state, "train": train, "resumed_lr": resumed_lr, "family": sharded.plan.family}


def _resume_plain(path):
    model, args, kwargs = _model("gpt2-tiny")
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    sched = _scheduler(opt)
    train = {"step": 0}
    autopar.load(path, model, opt, extra={"scheduler": sched, "train": train})
    _steps(model, opt, sched, args, kwargs, STEPS)
    return {"state": _state_of(model, opt), "train": train}


def _uninterrupted():
    model, args, kwargs = _model("gpt2-tiny")
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    sched = _scheduler(opt)
    _steps(model, opt, sched, args, kwargs, STEPS)
    halfway = _state_of(model, opt)
    _steps(model, opt, sched, args, kwargs, STEPS)
    return halfway, _state_of(model, opt)


def _assert_same_state(got, want, what, *, own_moments=False):
    """``own_moments``: a pipeline rank holds the optimizer state of its stages' weights only."""
    assert got["lr"] == pytest.approx(want["lr"], rel=1e-12), what
    if own_moments:
        assert got["moments"] and set(got["moments"]) < set(want["moments"]), (what, sorted(got["moments"]))
        want = dict(want, moments={k: want["moments"][k] for k in got["moments"]})
    for part in ("params", "moments"):
        assert set(got[part]) == set(want[part]), (what, part, set(got[part]) ^ set(want[part]))
        for k, v in want[part].items():
            torch.testing.assert_close(got[part][k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{what} {k}: {m}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step-2")
    ranks = run_ranks(_save_rank, 4, path)
    return path, ranks


@pytest.fixture(scope="module")
def reference():
    return _uninterrupted()


def test_the_saved_checkpoint_is_the_models_full_state_read_by_dcps_own_tools(saved, reference, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, ranks = saved
    assert "tensor parallel" in ranks[0]["family"]  # a real sharded plan, block-wise c_attn and an uneven vocab
    pieces = ranks[0]["pieces"]
    assert pieces["transformer.h.0.attn.c_attn.weight"][0][1] == Shard(1, 3)  # block-wise
    uneven = [k for k, (pl, local) in pieces.items() if any(isinstance(p, Shard) for p in pl) and 1001 in
              [s * 2 - 1 for s in local]]  # fmt: skip
    assert uneven, pieces  # vocab 1001 split in two: 501 + 500
    dcp_to_torch_save(path, tmp_path / "full.pt")
    loaded = torch.load(tmp_path / "full.pt", weights_only=False)
    full = ranks[0]["state"]["params"]
    assert "lm_head.weight" in full and "lm_head.weight" not in loaded["model"]  # a tied alias is stored once
    assert set(loaded["model"]) == set(full) - {"lm_head.weight"}
    for k, v in loaded["model"].items():
        assert torch.equal(v, full[k]), k
    for k, v in ranks[0]["state"]["moments"].items():
        fqn, name = k.rsplit(".", 1)
        assert torch.equal(loaded["optimizer"]["state"][fqn][name], v), k
    assert loaded["train"] == {"step": STEPS}
    # the run before the save is the single-device run's first half
    _assert_same_state(ranks[0]["state"], reference[0], "saved on 2x2")


def test_each_rank_writes_only_chunks_of_its_own_pieces_and_each_element_once(saved):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path, ranks = saved
    md = dcp.FileSystemReader(path).read_metadata()
    writer_of = {
        (i.fqn, tuple(i.offset)): int(info.relative_path.split("_")[2])
        for i, info in md.storage_data.items()
        if i.offset is not None
    }
    mesh_shape = (2, 2)
    checked = 0
    for key, tmd in md.state_dict_metadata.items():
        if not (isinstance(tmd, TensorStorageMetadata) and key.startswith("model.")):
            continue
        fqn = key[len("model.") :]
        placements, _ = ranks[0]["pieces"][fqn]
        assert sum(math.prod(c.sizes) for c in tmd.chunks) == math.prod(tmd.size), key  # no element twice
        for chunk in tmd.chunks:
            rank = writer_of[(key, tuple(chunk.offsets))]
            coord = coordinates(mesh_shape)[rank]
            boxes = piece_boxes(tuple(tmd.size), placements, mesh_shape, coord)
            assert any(
                all(
                    b.offsets[d] <= o and o + s <= b.offsets[d] + b.sizes[d]
                    for d, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True))
                )
                for b in boxes
            ), (key, rank, chunk)
            checked += 1
    assert checked > len(ranks[0]["pieces"])  # sharded tensors wrote several chunks


def test_the_mesh_checkpoint_exports_for_serving_as_the_full_state_and_its_tied_alias(saved, tmp_path):
    """``export_safetensors`` (tests/test_checkpoint_export.py) on chunks that four ranks wrote."""
    import json

    from safetensors.torch import load_file

    from autopar.checkpoint import export_safetensors, saved_info

    path, ranks = saved
    info = saved_info(path)
    assert info["mesh"] == [2, 2] and info["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    result = export_safetensors(path, tmp_path / "out", include_tied=True, max_shard_bytes=64 * 1024)
    full = ranks[0]["state"]["params"]
    index = json.loads(result.index.read_text())
    assert set(index["weight_map"]) == set(full) and result.tensors == len(full)
    got = {k: v for f in result.files for k, v in load_file(f.path).items()}
    for k, v in full.items():
        assert torch.equal(got[k], v), k


RESUMES = [
    ((4,), ("dp",), {"mem_cap": "cap"}),  # a capped plan on 4 ranks
    ((2,), ("dp",), {"family": "data parallel"}),
]


def _cap_bytes():
    """A cap below the uncapped (4,) plan's memory, so the resumed plan is another one (test_execution_zero)."""
    from test_execution_zero import _zero_plan

    return _zero_plan((4,), ("dp",), 0.8)[0]


@pytest.mark.parametrize("mesh_shape,axis_names,options", RESUMES, ids=["4-capped", "2-data-parallel"])
def test_training_resumed_under_another_plan_ends_where_an_uninterrupted_run_ends(
    saved, reference, mesh_shape, axis_names, options
):
    path, ranks = saved
    options = {k: (_cap_bytes() if v == "cap" else v) for k, v in options.items()}
    resumed = run_ranks(_resume_rank, math.prod(mesh_shape), path, mesh_shape, axis_names, options)
    assert resumed[0]["family"] != ranks[0]["family"]
    assert resumed[0]["train"] == {"step": STEPS}
    assert resumed[0]["resumed_lr"] == pytest.approx(ADAMW["lr"] * LR_DECAY**STEPS)
    for r in resumed:
        _assert_same_state(r["state"], reference[1], f"resumed on {mesh_shape} {resumed[0]['family']}")


def test_a_plain_module_in_one_process_loads_the_mesh_checkpoint_and_resumes(saved, reference):
    path, _ = saved
    got = _resume_plain(path)
    assert got["train"] == {"step": STEPS}
    _assert_same_state(got["state"], reference[1], "resumed on one process")


# ---- pipelines (issue 31): a rank holds its stages' weights, and the checkpoint reshards across stages --------

PIPELINE = {"pipeline": "pp", "microbatches": 2, "family": "tensor parallel"}  # 2 stages x tensor parallel 2


def _pipelined_save_rank(rank, world, path):
    model, args, kwargs = _model("gpt2-tiny")
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "tp"))
    sharded = autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, **PIPELINE
    )
    opt = torch.optim.AdamW(sharded.parameters(), **ADAMW)
    sched = _scheduler(opt)
    _steps(sharded, opt, sched, args, kwargs, STEPS)
    autopar.save(path, sharded, opt, extra={"scheduler": sched, "train": {"step": STEPS}})
    return {"state": _state_of(sharded, opt), "family": sharded.plan.family}


def test_a_pipelined_checkpoint_resumes_without_a_pipeline_and_in_one_process(tmp_path, reference):
    """Saved under 2 stages x tensor parallel 2 (each stage's ranks write its weights, GPT-2's tied embedding by
    the first stage), resumed under (4,) without a pipeline and in one plain process: each ends as the
    uninterrupted one-device run."""
    path = str(tmp_path / "pipelined")
    saved = run_ranks(_pipelined_save_rank, 4, path)
    assert "tensor parallel" in saved[0]["family"]
    for rank, r in enumerate(saved):
        _assert_same_state(r["state"], reference[0], f"pipelined save, rank {rank}", own_moments=True)
    resumed = run_ranks(_resume_rank, 4, path, (4,), ("dp",), {})
    for r in resumed:
        assert r["train"] == {"step": STEPS}
        _assert_same_state(r["state"], reference[1], f"resumed on (4,) {resumed[0]['family']}")
    plain = _resume_plain(path)
    _assert_same_state(plain["state"], reference[1], "the pipelined checkpoint resumed in one process")


def test_a_checkpoint_without_a_pipeline_resumes_under_two_stages(saved, reference):
    path, _ = saved
    resumed = run_ranks(_resume_rank, 4, path, (2, 2), ("pp", "tp"), PIPELINE)
    moments = set()
    for rank, r in enumerate(resumed):
        assert r["train"] == {"step": STEPS}
        _assert_same_state(r["state"], reference[1], f"resumed on 2 stages, rank {rank}", own_moments=True)
        moments |= set(r["state"]["moments"])
    assert moments == set(reference[1]["moments"])  # the stages together hold every weight's state


# ---- faults --------------------------------------------------------------------------------------------


class _DieMidWrite:
    """A FileSystemWriter that, on rank 1, writes half its first file and is killed (SIGKILL)."""

    def __new__(cls, path):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        class Writer(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                if dist.get_rank() == 1:
                    with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                        f.write(b"\0" * 4096)
                        f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return super().write_data(plan, planner)

        return Writer(path)


def _save_then_die(rank, world, path, die):
    model, args, kwargs = _model("gpt2-tiny")
    mesh = autopar.Mesh((2,), axis_names=("tp",))
    sharded = autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, family="tensor parallel"
    )
    if die:
        with torch.no_grad():
            for p in sharded.parameters():
                p.add_(1.0)  # a newer state that never lands
    staging = path + ".partial"
    autopar.save(path, sharded, storage_writer=_DieMidWrite(staging) if die else None)
    return sharded.full_state_dict()


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_and_is_rejected(tmp_path):
    path = str(tmp_path / "latest")
    first = run_ranks(_save_then_die, 2, path, False)[0]
    with pytest.raises(RankError, match=r"failed ranks \[0, 1\]"):  # rank 1 killed, rank 0 lost its peer
        run_ranks(_save_then_die, 2, path, True)
    assert os.path.isdir(path + ".partial")
    model, _, _ = _model("gpt2-tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    autopar.load(path, model)  # the previous checkpoint, untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, first[k]), k
    with pytest.raises(CheckpointError, match=r"no \.metadata.*interrupted"):
        autopar.load(path + ".partial", model)
    os.rename(path + ".partial", tmp_path / "first.partial")  # as if the first save ever had been killed
    with pytest.raises(CheckpointError, match="no checkpoint at .*first: .*first.partial holds an unfinished save"):
        autopar.load(tmp_path / "first", model)


def _gpt2(vocab=None):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=vocab or 101)
    return GPT2LMHeadModel(cfg)


def test_a_checkpoint_of_another_shape_names_the_first_mismatched_key_and_both_shapes(tmp_path):
    autopar.save(tmp_path / "a", _gpt2(101))
    with pytest.raises(CheckpointError) as err:
        autopar.load(tmp_path / "a", _gpt2(120))
    msg = str(err.value)
    assert "model.transformer.wte.weight: the checkpoint holds shape (101, 32), this model (120, 32)" in msg
    assert "saved from GPT2LMHeadModel on mesh one process" in msg and "strict=False" in msg


def test_a_checkpoint_of_another_model_lists_the_keys_on_each_side_and_strict_false_loads_what_matches(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    autopar.save(tmp_path / "a", _gpt2())
    llama = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=101,
        )
    )
    with pytest.raises(
        CheckpointError,
        match=r"(?s)key\(s\) of this model are not in the checkpoint: model\.lm_head"
        r".*key\(s\) in the checkpoint's model are not in this module: model\.transformer",
    ):
        autopar.load(tmp_path / "a", llama)
    bigger = _gpt2()
    bigger.extra = torch.nn.Linear(2, 2)  # one module more: strict=False loads the rest and leaves it
    before = bigger.extra.weight.detach().clone()
    with torch.no_grad():
        bigger.transformer.wte.weight.zero_()
    autopar.load(tmp_path / "a", bigger, strict=False)
    assert torch.equal(bigger.transformer.wte.weight, _gpt2().transformer.wte.weight)
    assert torch.equal(bigger.extra.weight, before)


def test_an_optimizer_asks_for_state_the_checkpoint_does_not_hold(tmp_path):
    model = _gpt2()
    autopar.save(tmp_path / "a", model)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="holds no optimizer state.*optimizer=None"):
        autopar.load(tmp_path / "a", model, opt)


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    model = _gpt2()
    autopar.save(tmp_path / "a", model)
    with torch.no_grad():
        model.transformer.wte.weight.add_(1)
    autopar.save(tmp_path / "a", model)
    assert sorted(os.listdir(tmp_path)) == ["a"]
    fresh = _gpt2()
    autopar.load(tmp_path / "a", fresh)
    assert torch.equal(fresh.transformer.wte.weight, model.transformer.wte.weight)


# ---- autopar run --save / --resume ---------------------------------------------------------------------
# A run saving every step on (2, 2) and one resuming it on (2,), each checked against one device trained without a
# stop (--check: a FAIL exits 1), are docs/guide/checkpoints.md's commands, which tests/test_docs.py runs.


def test_autopar_run_refuses_a_resume_it_cannot_continue_before_starting_ranks(tmp_path, capsys):
    from autopar.cli import main

    autopar.save(tmp_path / "ck" / "step-3", _gpt2(), extra={"train": {"step": 3}})
    os.makedirs(tmp_path / "ck" / "step-5.partial")  # an interrupted save never counts
    cases = [
        (["--steps", "3", "--resume", str(tmp_path / "ck")], r"step-3 has done 3 steps, --steps is 3; pass --steps"),
        (["--steps", "4", "--resume", str(tmp_path / "none")], r"no checkpoint at .*none: not a directory"),
        (["--save-every", "2"], r"--save-every 2: checkpoints need a directory; add --save DIR"),
    ]
    autopar.save(
        tmp_path / "drop" / "step-1",
        _gpt2(),
        extra={
            "train": {
                "step": 1,
                "run": {"model": "gpt2-tiny", "seed": 0, "batch": 4, "seq": 32, "lr": 1e-3, "check": False},
            }
        },
    )
    cases += [
        (
            ["--steps", "3", "--check", "--resume", str(tmp_path / "drop")],
            r"trained with check False \(now True\).*"
            r"save with --check \(dropout off\)",
        ),
        (["--steps", "4", "--check", "--resume", str(tmp_path / "ck")], r"does not say how it was trained"),
    ]
    for flags, message in cases:
        assert main(["run", "gpt2-tiny", *flags]) == 2
        assert re.search(message, capsys.readouterr().err), flags
