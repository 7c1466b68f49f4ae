"""Rules for data movement: views, lookups, attention, factories (and their kernels).

Every registered op is validated on random data over meshes (2,), (4,) and (2, 2)
with ``strategies.validate.assert_rule_valid``: each strategy's local op (or
kernel) on every simulated rank, with global size arguments made local, combined
by the output placements, must equal the full op.
"""

from __future__ import annotations

import pytest
import torch

from autopar.placement import Replicate, Shard
from autopar.strategies.base import expand_to_mesh, registered_targets, rule_for
from autopar.strategies.kernels import KERNELS, KernelContext
from autopar.strategies.validate import assert_rule_valid, make_call

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2)]
R = Replicate()


# ----------------------------------------------------------------------------- harness


def _label(s) -> str:
    k = sorted({k for k in s.kernels if k})
    return s.label() + (f" @{','.join(k)}" if k else "")


def check(target, *args, mesh=(2,), hints=(), **kwargs) -> set[str]:
    """Validate every strategy of ``target(*args, **kwargs)`` on ``mesh``; return their labels.

    A label reads ``<inputs> -> <outputs>``, one parenthesized placement tuple per
    tensor (one placement per mesh axis), plus `` @kernel`` when a kernel runs.
    """
    hints = frozenset(hints)
    checks = assert_rule_valid(target, args, kwargs, mesh_shape=mesh, block_hints=hints)
    strategies = [c.strategy for c in checks]
    assert not any(s.fallback for s in strategies), f"{target}: reported as fallback"
    return {_label(s) for s in strategies}


def rnd(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def has(labels: set[str], *wanted: str) -> None:
    missing = [w for w in wanted if w not in labels]
    assert not missing, f"missing strategies {missing}; offered {sorted(labels)}"


def lacks(labels: set[str], *unwanted: str) -> None:
    present = [w for w in unwanted if w in labels]
    assert not present, f"strategies {present} must not be offered; offered {sorted(labels)}"


# ----------------------------------------------------------------------------- view / reshape


@pytest.mark.parametrize("mesh", MESHES + [(8,)])
def test_view_splits_hidden_into_heads(mesh):
    """GPT-2's view (2,16,768)->(2,16,12,64), head dim cut to 4: S(2) moves to the 12 heads when 12 % axis == 0."""
    labels = check(aten.view.default, rnd(2, 16, 48), [2, 16, -1, 4], mesh=mesh)
    if mesh == (2,):
        has(
            labels,
            "(S(0)) -> (S(0))",
            "(S(1)) -> (S(1))",
            "(S(2)) -> (S(2))",
            "(P(sum)) -> (P(sum))",
            "(P(max)) -> (P(max))",
        )
    if mesh == (4,):
        has(labels, "(S(2)) -> (S(2))", "(S(1)) -> (S(1))")
        lacks(labels, "(S(0)) -> (S(0))")  # batch 2 < 4 ranks
    if mesh == (2, 2):
        has(labels, "(S(0),S(2)) -> (S(0),S(2))", "(S(2),S(2)) -> (S(2),S(2))", "(S(2),P(sum)) -> (S(2),P(sum))")
    if mesh == (8,):
        lacks(labels, "(S(2)) -> (S(2))")  # 12 heads do not split evenly over 8
        has(labels, "(S(1)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_view_merges_batch_and_sequence(mesh):
    """view (2,16,48)->(32,48): S on batch (outer) moves to the merged dim; S on sequence is not offered."""
    labels = check(aten.view.default, rnd(2, 16, 48), [-1, 48], mesh=mesh)
    assert not any(lab.startswith("(S(1)") for lab in labels), sorted(labels)
    if len(mesh) == 1:
        has(labels, "(S(2)) -> (S(1))")
    if mesh == (2,):
        has(labels, "(S(0)) -> (S(0))")
    if mesh == (2, 2):
        has(labels, "(S(0),S(2)) -> (S(0),S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_view_uneven_one_to_one_dims(mesh):
    """(3,5,7)->(15,7): the 7-dim maps 1:1 and shards unevenly; the 3-dim (odd) never moves into 15."""
    labels = check(aten.reshape.default, rnd(3, 5, 7), [15, 7], mesh=mesh)
    lacks(labels, "(S(0)) -> (S(0))")
    if len(mesh) == 1:
        has(labels, "(S(2)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_reshape_gqa_kv_heads_merge(mesh):
    """Llama's repeat_kv: (2,2,4,16,8)->(2,8,16,8) keeps S on the 2 kv heads only if 2 % axis == 0."""
    x = rnd(2, 2, 1, 16, 8).expand(2, 2, 4, 16, 8)
    labels = check(aten.reshape.default, x, [2, 8, 16, 8], mesh=mesh)
    if mesh == (2,):
        has(labels, "(S(1)) -> (S(1))", "(S(3)) -> (S(2))")
    if mesh == (4,):
        lacks(labels, "(S(1)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_view_block_shard_of_fused_qkv(mesh):
    """Fused qkv (3 x 12 heads of 4): (32,144)->(2,16,144) and (2,16,144)->(2,16,36,4) carry S[3]
    when a consumer asks for 3 blocks."""
    labels = check(aten.view.default, rnd(32, 144), [2, 16, 144], mesh=mesh, hints={(0, 2, 3)})
    labels2 = check(aten._unsafe_view.default, rnd(2, 16, 144), [2, 16, 36, 4], mesh=mesh, hints={(0, 2, 3)})
    if len(mesh) == 1:
        has(labels, "(S(1)[3]) -> (S(2)[3])", "(S(1)) -> (S(2))")
        has(labels2, "(S(2)[3]) -> (S(2)[3])")
    else:
        has(labels, "(S(1)[3],S(1)[3]) -> (S(2)[3],S(2)[3])")
        has(labels2, "(S(2)[3],S(2)[3]) -> (S(2)[3],S(2)[3])")


@pytest.mark.parametrize("mesh", MESHES)
def test_reshape_as_and_view_as_take_other_laid_out_as_the_output(mesh):
    """RoFormer's ``x.reshape_as(y)``: ``other`` carries the output's shard (its local shape is the piece's)."""
    lr = check(aten.reshape_as.default, rnd(3, 8, 6, 2), rnd(3, 8, 12), mesh=mesh)
    lv = check(aten.view_as.default, rnd(3, 8, 12), rnd(3, 8, 6, 2), mesh=mesh)
    if mesh == (2,):
        has(lr, "(S(0)) (S(0)) -> (S(0))", "(S(2)) (S(2)) -> (S(2))", "(P(sum)) (R) -> (P(sum))")
        has(lv, "(S(1)) (S(1)) -> (S(1))", "(S(2)) (S(2)) -> (S(2))")


@pytest.mark.parametrize("mesh", MESHES)
def test_flatten_and_unflatten(mesh):
    labels = check(aten.flatten.using_ints, rnd(2, 8, 12, 4), 2, 3, mesh=mesh)
    labels2 = check(aten.unflatten.int, rnd(2, 8, 48), 2, [12, 4], mesh=mesh)
    if len(mesh) == 1:
        has(labels, "(S(2)) -> (S(2))")
        lacks(labels, "(S(3)) -> (S(2))")
        has(labels2, "(S(2)) -> (S(2))")


# ----------------------------------------------------------------------------- permutations, (un)squeeze, expand


@pytest.mark.parametrize("mesh", MESHES)
def test_transpose_permute_t(mesh):
    labels = check(aten.transpose.int, rnd(2, 16, 12, 4), 1, 2, mesh=mesh)
    labels_p = check(aten.permute.default, rnd(2, 4, 6, 5), [0, 2, 3, 1], mesh=mesh)
    labels_t = check(aten.t.default, rnd(5, 7), mesh=mesh)  # uneven on 4 ranks
    if len(mesh) == 1:
        has(labels, "(S(2)) -> (S(1))", "(S(1)) -> (S(2))", "(P(sum)) -> (P(sum))")
        has(labels_p, "(S(1)) -> (S(3))", "(S(3)) -> (S(2))")
        has(labels_t, "(S(0)) -> (S(1))", "(S(1)) -> (S(0))")
    else:
        has(labels, "(S(0),S(2)) -> (S(0),S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_numpy_T_mT_swapaxes_movedim(mesh):
    """Falcon's ``weight.T`` (numpy_T) and the other permutation spellings follow their dims."""
    lT = check(aten.numpy_T.default, rnd(5, 7), mesh=mesh)  # uneven on 4 ranks
    lT3 = check(aten.numpy_T.default, rnd(2, 4, 6), mesh=mesh)
    lmT = check(aten.mT.default, rnd(2, 4, 6), mesh=mesh)
    lsw = check(aten.swapaxes.default, rnd(2, 4, 6), 0, -1, mesh=mesh)
    lsd = check(aten.swapdims.default, rnd(2, 4, 6), 0, 1, mesh=mesh)
    lmv = check(aten.movedim.int, rnd(2, 4, 6), 0, 2, mesh=mesh)
    lmvl = check(aten.movedim.intlist, rnd(2, 4, 6, 8), [0, 1], [3, 0], mesh=mesh)
    if mesh == (2,):
        has(lT, "(S(0)) -> (S(1))", "(S(1)) -> (S(0))", "(P(sum)) -> (P(sum))")
        has(lT3, "(S(0)) -> (S(2))", "(S(1)) -> (S(1))", "(S(2)) -> (S(0))")
        has(lmT, "(S(0)) -> (S(0))", "(S(1)) -> (S(2))", "(S(2)) -> (S(1))")
        has(lsw, "(S(0)) -> (S(2))", "(S(1)) -> (S(1))")
        has(lsd, "(S(0)) -> (S(1))")
        has(lmv, "(S(0)) -> (S(2))", "(S(1)) -> (S(0))", "(S(2)) -> (S(1))")
        has(lmvl, "(S(0)) -> (S(3))", "(S(1)) -> (S(0))", "(S(2)) -> (S(1))", "(S(3)) -> (S(2))")


@pytest.mark.parametrize("mesh", MESHES)
def test_transpose_keeps_block_shards_when_hinted(mesh):
    labels = check(aten.transpose.int, rnd(2, 12, 16), 1, 2, mesh=mesh, hints={(0, 2, 3)})
    if len(mesh) == 1:
        has(labels, "(S(1)[3]) -> (S(2)[3])")


@pytest.mark.parametrize("mesh", MESHES)
def test_unsqueeze_and_squeeze(mesh):
    lu = check(aten.unsqueeze.default, rnd(16, 6), 0, mesh=mesh)
    lu2 = check(aten.unsqueeze.default, rnd(16, 6), -1, mesh=mesh)
    ls = check(aten.squeeze.default, rnd(2, 1, 12), mesh=mesh)
    ls_small = check(aten.squeeze.default, rnd(12, 1, 4), mesh=mesh)
    ld = check(aten.squeeze.dim, rnd(32, 1), 1, mesh=mesh)
    lds = check(aten.squeeze.dims, rnd(2, 1, 5, 1), [1, 3], mesh=mesh)
    if mesh == (4,):
        has(lu, "(S(0)) -> (S(1))", "(S(1)) -> (S(2))")
        has(lu2, "(S(0)) -> (S(0))", "(S(1)) -> (S(1))")
        has(ls, "(S(2)) -> (S(1))")  # 12 on 4 ranks: 3 each, never squeezed locally
        # 4 on 4 ranks leaves a size-1 piece that squeeze() would drop locally
        lacks(ls_small, "(S(2)) -> (S(1))")
        has(ls_small, "(S(0)) -> (S(0))")
        has(ld, "(S(0)) -> (S(0))")
        has(lds, "(S(2)) -> (S(1))")  # 5 on 4 ranks: a size-1 piece is fine, dim 2 is not named


@pytest.mark.parametrize("mesh", MESHES)
def test_expand_shards_broadcast_dims_from_replicated_input(mesh):
    """GPT-2's expand of position ids (1,16)->(2,16) and a mask (1,1,16,16)->(2,12,16,16)."""
    lab = check(aten.expand.default, rnd(1, 16), [2, -1], mesh=mesh)
    lab_m = check(aten.expand.default, rnd(1, 1, 16, 16), [2, 12, 16, 16], mesh=mesh)
    lab_new = check(aten.expand.default, rnd(16), [4, 16], mesh=mesh)
    if mesh == (2,):
        has(lab, "(R) -> (S(0))", "(S(1)) -> (S(1))", "(P(sum)) -> (P(sum))")
        has(lab_m, "(R) -> (S(0))", "(R) -> (S(1))", "(S(2)) -> (S(2))", "(S(3)) -> (S(3))")
    if mesh == (2, 2):
        has(lab_m, "(R,R) -> (S(0),S(1))", "(R,S(2)) -> (S(1),S(2))")
    if mesh == (4,):
        has(lab_new, "(R) -> (S(0))", "(S(0)) -> (S(1))")


# ----------------------------------------------------------------------------- slice / select


@pytest.mark.parametrize("mesh", MESHES)
def test_slice_and_select(mesh):
    part = check(aten.slice.Tensor, rnd(4, 17), 1, 1, 2**63 - 1, mesh=mesh)  # GPT-2's shifted labels
    full = check(aten.slice.Tensor, rnd(4, 6), 1, 0, 2**63 - 1, mesh=mesh)
    step = check(aten.slice.Tensor, rnd(6, 8), 0, 0, 6, 2, mesh=mesh)
    sel = check(aten.select.int, rnd(4, 6, 5), 1, 2, mesh=mesh)
    if mesh == (2,):
        has(part, "(S(0)) -> (S(0))", "(P(sum)) -> (P(sum))")
        lacks(part, "(S(1)) -> (S(1))")
        has(full, "(S(1)) -> (S(1))", "(S(0)) -> (S(0))")
        has(step, "(S(1)) -> (S(1))")
        lacks(step, "(S(0)) -> (S(0))")
        has(sel, "(S(0)) -> (S(0))", "(S(2)) -> (S(1))")
        lacks(sel, "(S(1)) -> (S(1))")


# ----------------------------------------------------------------------------- split family


@pytest.mark.parametrize("mesh", MESHES)
def test_split_of_fused_qkv_gives_plain_shards(mesh):
    """GPT-2's split of c_attn's (2,16,2304) into q,k,v (3 x 12 heads of 4 here): S(2)[3] -> S(2) on each."""
    x = rnd(2, 16, 144)
    labels = check(aten.split.Tensor, x, 48, 2, mesh=mesh)
    if len(mesh) == 1:
        has(
            labels,
            "(S(2)[3]) -> (S(2)) (S(2)) (S(2))",
            "(S(1)) -> (S(1)) (S(1)) (S(1))",
            "(P(sum)) -> (P(sum)) (P(sum)) (P(sum))",
        )
        lacks(labels, "(S(2)) -> (S(2)) (S(2)) (S(2))")
    else:
        # both axes split heads: each axis shards the piece the earlier axis left, 3 blocks each
        has(
            labels,
            "(S(2)[3],S(1)) -> (S(2),S(1)) (S(2),S(1)) (S(2),S(1))",
            "(S(2)[3],S(2)[3]) -> (S(2),S(2)) (S(2),S(2)) (S(2),S(2))",
        )


@pytest.mark.parametrize("mesh", MESHES)
def test_split_uneven_blocks_and_variants(mesh):
    """3 blocks of 10 on 4 ranks (3,3,2,2 per block); chunk; split_with_sizes; unbind."""
    ls = check(aten.split.Tensor, rnd(4, 30), 10, 1, mesh=mesh)
    lc = check(aten.chunk.default, rnd(4, 30), 3, 1, mesh=mesh)
    lw = check(aten.split_with_sizes.default, rnd(6, 10), [5, 5], 1, mesh=mesh)
    lw2 = check(aten.split_with_sizes.default, rnd(6, 10), [4, 6], -1, mesh=mesh)
    lu = check(aten.unbind.int, rnd(3, 4, 6), 1, mesh=mesh)
    ltail = check(aten.split.Tensor, rnd(6, 10), 4, 1, mesh=mesh)  # pieces 4, 4, 2
    if mesh == (4,):
        has(ls, "(S(1)[3]) -> (S(1)) (S(1)) (S(1))", "(S(0)) -> (S(0)) (S(0)) (S(0))")
        has(lc, "(S(1)[3]) -> (S(1)) (S(1)) (S(1))")
        has(lw, "(S(1)[2]) -> (S(1)) (S(1))")
        has(lw2, "(S(0)) -> (S(0)) (S(0))")
        lacks(lw2, "(S(1)[2]) -> (S(1)) (S(1))")
        has(lu, "(S(2)) -> (S(1)) (S(1)) (S(1)) (S(1))")
        has(ltail, "(S(0)) -> (S(0)) (S(0)) (S(0))")
    if mesh == (2, 2):
        has(ls, "(S(1)[3],S(1)[3]) -> (S(1),S(1)) (S(1),S(1)) (S(1),S(1))")  # 10 -> 5,5 -> 3,2 per block
        has(lw, "(S(1)[2],S(1)[2]) -> (S(1),S(1)) (S(1),S(1))")


# ----------------------------------------------------------------------------- cat / stack / pad


@pytest.mark.parametrize("mesh", MESHES)
def test_cat_and_stack(mesh):
    a, b = rnd(2, 4, 8), rnd(2, 4, 8)
    lc = check(aten.cat.default, [a, b], -1, mesh=mesh)
    lc_uneq = check(aten.cat.default, [rnd(4, 3), rnd(4, 5)], 1, mesh=mesh)
    ls = check(aten.stack.default, [rnd(3, 4), rnd(3, 4)], 1, mesh=mesh)
    if mesh == (2,):
        has(
            lc,
            "(S(0)) (S(0)) -> (S(0))",
            "(S(1)) (S(1)) -> (S(1))",
            "(S(2)) (S(2)) -> (S(2)[2])",
            "(P(sum)) (P(sum)) -> (P(sum))",
            "(P(max)) (P(max)) -> (P(max))",
        )
        has(lc_uneq, "(S(0)) (S(0)) -> (S(0))")
        lacks(lc_uneq, "(S(1)) (S(1)) -> (S(1)[2])")
        has(ls, "(S(0)) (S(0)) -> (S(0))", "(S(1)) (S(1)) -> (S(2))")
    if mesh == (2, 2):
        has(lc, "(S(2),S(2)) (S(2),S(2)) -> (S(2)[2],S(2)[2])")


@pytest.mark.parametrize("mesh", MESHES)
def test_concat_is_cat(mesh):
    labels = check(aten.concat.default, [rnd(3, 4), rnd(3, 4)], 1, mesh=mesh)
    labels2 = check(aten.concatenate.default, [rnd(3, 4), rnd(5, 4)], 0, mesh=mesh)
    if mesh == (2,):
        has(labels, "(S(0)) (S(0)) -> (S(0))", "(S(1)) (S(1)) -> (S(1)[2])")
        has(labels2, "(S(1)) (S(1)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_slice_and_select_scatter(mesh):
    """What in-place writes through a view become: T5's ``shifted[..., 1:] = ids[..., :-1]``."""
    ids = torch.randint(0, 50, (3, 8))
    l_int = check(aten.slice_scatter.default, torch.zeros(3, 8, dtype=torch.long), ids[:, :-1], 1, 1, mesh=mesh)
    l_sl = check(aten.slice_scatter.default, rnd(5, 6, 4), rnd(5, 2, 4), 1, 2, 4, mesh=mesh)
    l_se = check(aten.select_scatter.default, rnd(5, 6, 4), rnd(5, 4), 1, 3, mesh=mesh)
    if mesh == (2,):
        has(l_int, "(S(0)) (S(0)) -> (S(0))")
        lacks(l_int, "(S(1)) (S(1)) -> (S(1))", "(P(sum)) (P(sum)) -> (P(sum))")
        has(l_sl, "(S(0)) (S(0)) -> (S(0))", "(S(2)) (S(2)) -> (S(2))", "(P(sum)) (P(sum)) -> (P(sum))")
        has(l_se, "(S(0)) (S(0)) -> (S(0))", "(S(2)) (S(1)) -> (S(2))", "(P(max)) (P(max)) -> (P(max))")


@pytest.mark.parametrize("mesh", MESHES)
def test_repeat_and_repeat_interleave(mesh):
    """A repeated dim gives a block shard (rank r's piece of every copy); kept dims keep theirs."""
    lr = check(aten.repeat.default, rnd(3, 4, 6), [1, 2, 1], mesh=mesh)  # Bloom/GPT-J style
    lr_lead = check(aten.repeat.default, rnd(5, 6), [2, 1, 3], mesh=mesh)  # a new leading dim, uneven 5
    li = check(aten.repeat_interleave.self_int, rnd(3, 4, 8), 2, 2, mesh=mesh)  # GPT-J's rotary sin/cos
    li_odd = check(aten.repeat_interleave.self_int, rnd(3, 4, 6), 2, -1, mesh=mesh)
    li_flat = check(aten.repeat_interleave.self_int, rnd(3, 4), 2, mesh=mesh)
    if mesh == (2,):
        has(lr, "(S(0)) -> (S(0))", "(S(1)) -> (S(1)[2])", "(S(2)) -> (S(2))", "(P(sum)) -> (P(sum))")
        has(lr_lead, "(S(0)) -> (S(1))", "(S(1)) -> (S(2)[3])")
        lacks(lr_lead, "(R) -> (S(0))")
        has(li, "(S(0)) -> (S(0))", "(S(1)) -> (S(1))", "(S(2)) -> (S(2))")
        has(li_flat, "(P(sum)) -> (P(sum))")
    if mesh == (4,):
        lacks(li_odd, "(S(2)) -> (S(2))")  # 6 rows on 4 ranks: pieces 2,2,1,1 -> 4,4,2,2 != chunks of 12
    if mesh == (2, 2):
        has(lr, "(S(1),S(1)) -> (S(1)[2],S(1)[2])")


@pytest.mark.parametrize("mesh", MESHES)
def test_pad(mesh):
    labels_int = torch.randint(0, 50, (4, 16))
    li = check(aten.pad.default, labels_int, [0, 1], "constant", -100.0, mesh=mesh)  # GPT-2's shifted labels
    lc = check(aten.pad.default, rnd(4, 6, 5), [1, 2], "constant", 0.5, mesh=mesh)
    lz = check(aten.pad.default, rnd(4, 6, 5), [1, 2, 0, 0], mesh=mesh)
    lr = check(aten.pad.default, rnd(2, 4, 8), [2, 2], "reflect", mesh=mesh)
    ln = check(aten.constant_pad_nd.default, rnd(4, 6), [0, 0, 1, 1], 0.0, mesh=mesh)
    if mesh == (4,):
        has(li, "(S(0)) -> (S(0))")
        lacks(li, "(S(1)) -> (S(1))")
        has(lc, "(S(0)) -> (S(0))", "(S(1)) -> (S(1))", "(P(max)) -> (P(max))")
        lacks(lc, "(P(sum)) -> (P(sum))", "(S(2)) -> (S(2))")  # every rank would add the 0.5
        has(lz, "(P(sum)) -> (P(sum))")
        has(lr, "(S(1)) -> (S(1))", "(P(sum)) -> (P(sum))", "(P(max)) -> (P(max))")
        has(ln, "(S(1)) -> (S(1))")
        lacks(ln, "(S(0)) -> (S(0))")


# ----------------------------------------------------------------------------- embedding / gather / index_select


def _ids(vocab: int, *shape: int) -> torch.Tensor:
    """Random token ids that include the first and last row (so every shard is hit)."""
    ids = torch.randint(0, vocab, shape)
    flat = ids.view(-1)
    flat[0], flat[-1] = 0, vocab - 1
    return ids


@pytest.mark.parametrize("mesh", MESHES)
def test_embedding_three_strategies_with_uneven_vocab(mesh):
    """11 rows on 4 ranks (3,3,3,2): data parallel, embedding-dim and vocab-parallel all validate."""
    w, ids = rnd(11, 6), _ids(11, 2, 5)
    labels = check(aten.embedding.default, w, ids, mesh=mesh)
    if mesh == (2,):
        has(labels, "(R) (S(0)) -> (S(0))", "(R) (S(1)) -> (S(1))")
    if len(mesh) == 1:
        has(labels, "(S(1)) (R) -> (S(2))", "(S(0)) (R) -> (P(sum)) @masked_embedding")
        # the table split by rows and the indices split on the same axis cannot be combined
        assert not any(lab.startswith("(S(0)) (S(") for lab in labels), sorted(labels)
    if mesh == (4,):
        has(labels, "(R) (S(1)) -> (S(1))")  # 5 positions on 4 ranks
        lacks(labels, "(R) (S(0)) -> (S(0))")  # batch 2 < 4
    if mesh == (2, 2):
        has(
            labels,
            "(S(0),S(0)) (R,R) -> (P(sum),P(sum)) @masked_embedding",
            "(S(0),R) (R,S(0)) -> (P(sum),S(0)) @masked_embedding",
            "(R,S(0)) (S(0),R) -> (S(0),P(sum)) @masked_embedding",
            "(S(0),S(1)) (R,R) -> (P(sum),S(2)) @masked_embedding",
        )


def test_embedding_vocab_parallel_gpt2_vocab_on_4_ranks():
    """GPT-2's 50257-row vocabulary on (4,): rows 12565/12564/12564/12564, output P(sum)."""
    w, ids = rnd(50257, 2), _ids(50257, 2, 16)
    labels = check(aten.embedding.default, w, ids, mesh=(4,))
    has(labels, "(S(0)) (R) -> (P(sum)) @masked_embedding")


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_embedding_padding_idx(mesh):
    """padding_idx=3 (held by rank 1 of 4) changes nothing forward; every strategy still validates."""
    w, ids = rnd(11, 6), _ids(11, 3, 4)
    ids[1, 1] = 3
    labels = check(aten.embedding.default, w, ids, 3, mesh=mesh)
    vocab_parallel = "(S(0),S(0)) (R,R) -> (P(sum),P(sum))" if len(mesh) == 2 else "(S(0)) (R) -> (P(sum))"
    has(labels, vocab_parallel + " @masked_embedding")


def test_masked_embedding_gradient_keeps_padding_row_zero():
    """The kernel's backward: rows a rank holds get their gradient, the padding row none."""
    w, ids = rnd(11, 3), torch.tensor([[0, 3, 5, 10, 3]])
    full_grad = torch.zeros_like(w)
    for rank in range(4):
        ctx = KernelContext(
            (4,), (rank,), ((Shard(0),), (R,)), (make_call(aten.embedding.default, (w, ids))[0].inputs), (0,)
        )
        ((lo, hi),) = ctx.shard_ranges(0, 0)
        local = w[lo:hi].clone().requires_grad_()
        KERNELS["masked_embedding"](ctx, local, ids, 3).sum().backward()
        full_grad[lo:hi] = local.grad
    want = torch.zeros(11, 3, dtype=torch.float64)
    want[[0, 5, 10]] = 1.0
    assert torch.equal(full_grad, want)


@pytest.mark.parametrize("mesh", MESHES)
def test_gather_vocab_parallel_target_logit(mesh):
    """The decomposed cross-entropy's gather(z (6, 11), 1, t (6, 1)): class dim sharded -> P(sum)."""
    z, t = rnd(6, 11), _ids(11, 6, 1)
    labels = check(aten.gather.default, z, 1, t, mesh=mesh)
    if len(mesh) == 1:
        has(
            labels,
            "(S(1)) (R) -> (P(sum)) @masked_gather",
            "(S(0)) (S(0)) -> (S(0))",
            "(P(sum)) (R) -> (P(sum))",
            "(P(max)) (R) -> (P(max))",
        )
    else:
        has(
            labels,
            "(S(0),S(1)) (S(0),R) -> (S(0),P(sum)) @masked_gather",
            "(S(1),S(1)) (R,R) -> (P(sum),P(sum)) @masked_gather",
        )
    wide = check(aten.gather.default, rnd(4, 7), 1, _ids(7, 4, 3), mesh=mesh)
    if mesh == (2,):
        has(wide, "(R) (S(1)) -> (S(1))")  # positions along dim come from the index values
        # index split on a dim other than ``dim`` with a whole self would misalign positions
        lacks(wide, "(R) (S(0)) -> (S(0))")


def test_gather_int_bert_token_types():
    """BERT's gather of token_type_ids (1, 512) by position ids (1, 16): ints, no Partial."""
    labels = check(aten.gather.default, torch.zeros(1, 32, dtype=torch.long), 1, _ids(32, 1, 16), mesh=(2,))
    has(labels, "(R) (S(1)) -> (S(1))")
    assert not any("P(" in lab for lab in labels)


@pytest.mark.parametrize("mesh", MESHES)
def test_index_select(mesh):
    x, idx = rnd(7, 5), _ids(7, 4)
    labels = check(aten.index_select.default, x, 0, idx, mesh=mesh)
    if mesh == (4,):
        has(labels, "(S(0)) (R) -> (P(sum)) @masked_index_select", "(S(1)) (R) -> (S(1))", "(R) (S(0)) -> (S(0))")
    labels1 = check(aten.index_select.default, rnd(3, 9), 1, _ids(9, 5), mesh=mesh)
    if mesh == (2,):
        has(labels1, "(S(1)) (R) -> (P(sum)) @masked_index_select", "(R) (S(0)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_index_tensor_advanced_indexing(mesh):
    """``x[:, :, idx]`` (Falcon's multi-query split) and ``x[i, j]`` with broadcast index tensors (HF masks)."""
    x = rnd(3, 5, 8, 4)
    idx = torch.tensor([6])
    l_mid = check(aten.index.Tensor, x, [None, None, idx], mesh=mesh)
    i = torch.arange(3).view(3, 1)
    j = torch.randint(0, 7, (1, 6))
    l_bcast = check(aten.index.Tensor, rnd(3, 7), [i, j], mesh=mesh)
    l_apart = check(aten.index.Tensor, rnd(4, 5, 6), [_ids(4, 2, 3), None, _ids(6, 3)], mesh=mesh)
    l_ints = check(aten.index.Tensor, torch.arange(12).view(3, 4), [None, _ids(4, 5)], mesh=mesh)
    l_unsafe = check(aten._unsafe_index.Tensor, x, [None, _ids(5, 2, 3)], mesh=mesh)
    if mesh == (2,):
        has(l_mid, "(S(0)) (R) -> (S(0))", "(S(1)) (R) -> (S(1))", "(S(3)) (R) -> (S(3))")
        has(l_mid, "(P(sum)) (R) -> (P(sum))", "(P(max)) (R) -> (P(max))")
        lacks(l_mid, "(S(2)) (R) -> (S(2))")
        has(l_bcast, "(R) (S(0)) (R) -> (S(0))", "(R) (R) (S(1)) -> (S(1))")
        # indexed dims 0 and 2 are apart: the broadcast (2, 3) goes first, then dim 1
        has(l_apart, "(S(1)) (R) (R) -> (S(2))", "(R) (S(0)) (R) -> (S(0))", "(R) (S(1)) (S(0)) -> (S(1))")
        has(l_ints, "(S(0)) (R) -> (S(0))", "(R) (S(0)) -> (S(1))")
        assert not any("P(" in lab for lab in l_ints)
        has(l_unsafe, "(R) (S(0)) -> (S(1))", "(S(2)) (R) -> (S(3))")
    if mesh == (2, 2):
        has(l_mid, "(S(0),S(1)) (R,R) -> (S(0),S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_index_put_mixtral_scatter_add(mesh):
    """Mixtral's ``out.index_put_([token_idx], expert_out, accumulate=True)`` and a plain overwrite."""
    x, vals = rnd(7, 6), rnd(5, 6)
    la = check(aten.index_put.default, x, [_ids(7, 5)], vals, True, mesh=mesh)
    lw = check(aten.index_put.default, x, [torch.tensor([4, 0, 2])], rnd(3, 1), mesh=mesh)  # unique rows
    l_mid = check(aten.index_put.default, rnd(3, 5, 4), [None, torch.tensor([1, 3])], rnd(3, 2, 4), True, mesh=mesh)
    if mesh == (2,):
        has(la, "(S(1)) (R) (S(1)) -> (S(1))", "(P(sum)) (R) (P(sum)) -> (P(sum))")
        lacks(la, "(S(0)) (R) (S(0)) -> (S(0))")
        has(lw, "(S(1)) (R) (R) -> (S(1))", "(P(sum)) (R) (P(sum)) -> (P(sum))")
        has(l_mid, "(S(0)) (R) (S(0)) -> (S(0))", "(S(2)) (R) (S(2)) -> (S(2))")


@pytest.mark.parametrize("mesh", MESHES)
def test_scatter_and_scatter_add(mesh):
    """DeepSeek's group mask ``zeros_like(s).scatter_(1, idx, 1)``, a src scatter, and scatter_adds
    (one whose index is narrower than self on a dim it does not scatter: never sharded there)."""
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(5)])  # (5, 2): distinct positions per row
    lv = check(aten.scatter.value, rnd(5, 6), 1, idx, 1.0, mesh=mesh)
    ls = check(aten.scatter.src, rnd(5, 6), 1, idx, rnd(5, 2), mesh=mesh)
    la = check(aten.scatter_add.default, rnd(5, 6), 1, _ids(6, 5, 3), rnd(5, 3), mesh=mesh)
    l_short = check(aten.scatter_add.default, rnd(5, 6), 0, _ids(5, 3, 4), rnd(4, 6), mesh=mesh)
    if mesh == (2,):
        has(lv, "(S(0)) (S(0)) -> (S(0))")
        lacks(lv, "(S(1)) (S(1)) -> (S(1))", "(P(sum)) (R) -> (P(sum))")
        has(ls, "(S(0)) (S(0)) (S(0)) -> (S(0))", "(P(sum)) (R) (P(sum)) -> (P(sum))")
        has(la, "(S(0)) (S(0)) (S(0)) -> (S(0))", "(P(sum)) (R) (P(sum)) -> (P(sum))")
        lacks(l_short, "(S(1)) (S(1)) (S(1)) -> (S(1))")  # index 4 columns of 6: pieces would not line up


def test_index_tensor_with_a_bool_mask_is_not_sharded():
    x, m = rnd(4, 6), torch.tensor([True, False, True, True])
    call, _ = make_call(aten.index.Tensor, (x, [m]))
    assert rule_for(aten.index.Tensor)(call, 2) == []


# ----------------------------------------------------------------------------- attention


SDPA = aten.scaled_dot_product_attention.default


def _qkv(b, h, hkv, s, d, sk=None):
    sk = sk or s
    return rnd(b, h, s, d), rnd(b, hkv, sk, d), rnd(b, hkv, sk, d)


@pytest.mark.parametrize("mesh", MESHES)
def test_sdpa_batch_heads_and_query_sequence(mesh):
    q, k, v = _qkv(2, 4, 4, 6, 8)
    labels = check(SDPA, q, k, v, mesh=mesh)
    if mesh == (2,):
        has(labels, "(S(0)) (S(0)) (S(0)) -> (S(0))", "(S(1)) (S(1)) (S(1)) -> (S(1))", "(S(2)) (R) (R) -> (S(2))")
    if mesh == (4,):
        has(labels, "(S(1)) (S(1)) (S(1)) -> (S(1))", "(S(2)) (R) (R) -> (S(2))")  # 6 queries: 2,2,1,1
    if mesh == (2, 2):
        has(
            labels, "(S(0),S(1)) (S(0),S(1)) (S(0),S(1)) -> (S(0),S(1))", "(S(1),S(2)) (S(1),R) (S(1),R) -> (S(1),S(2))"
        )
    assert not any("P(" in lab for lab in labels)


@pytest.mark.parametrize("mesh", MESHES)
def test_sdpa_causal_shards_queries_through_the_global_positions_kernel(mesh):
    """``check`` runs every strategy's kernel on each rank's pieces and compares with the whole op: the query
    shards of a causal attention (6 queries: uneven on 4) match it through ``causal_query_rows``."""
    q, k, v = _qkv(2, 4, 4, 6, 8)
    labels = check(SDPA, q, k, v, is_causal=True, mesh=mesh)
    if mesh == (2,):
        has(labels, "(S(1)) (S(1)) (S(1)) -> (S(1))", "(S(2)) (R) (R) -> (S(2)) @causal_query_rows")
    if mesh == (4,):
        has(labels, "(S(2)) (R) (R) -> (S(2)) @causal_query_rows")
    if mesh == (2, 2):
        has(
            labels,
            "(S(1),S(2)) (S(1),R) (S(1),R) -> (S(1),S(2)) @causal_query_rows",
            "(S(2),S(2)) (R,R) (R,R) -> (S(2),S(2)) @causal_query_rows",
        )
    q, k, v = _qkv(2, 8, 2, 6, 4)  # GQA: the kernel keeps enable_gqa
    gqa = check(SDPA, q, k, v, is_causal=True, enable_gqa=True, mesh=mesh)
    assert any(lab.startswith("(S(2)") and lab.endswith("@causal_query_rows") for lab in gqa), sorted(gqa)


def test_causal_query_rows_on_a_rank_holding_no_rows():
    """3 queries on 4 ranks: the last holds none and computes an empty piece."""
    from autopar.spec import TensorMeta
    from autopar.strategies.attention import causal_query_rows

    q, k, v = _qkv(1, 2, 2, 3, 4)
    metas = tuple(TensorMeta(tuple(t.shape), t.dtype) for t in (q, k, v))
    ctx = KernelContext((4,), (3,), ((Shard(2),), (Replicate(),), (Replicate(),)), metas, (0,))
    assert ctx.shard_ranges(0, 2) == []
    assert causal_query_rows(ctx, q[:, :, 3:], k, v, is_causal=True).shape == (1, 2, 0, 4)


def test_sdpa_query_shard_with_causal_mask_would_be_wrong():
    """Why a causal query shard needs ``causal_query_rows``: the op itself puts the diagonal at local row 0."""
    q, k, v = _qkv(1, 1, 1, 4, 2)
    full = SDPA(q, k, v, is_causal=True)
    second_half = SDPA(q[:, :, 2:], k, v, is_causal=True)
    assert not torch.allclose(second_half, full[:, :, 2:])


@pytest.mark.parametrize("mesh", MESHES)
def test_sdpa_gqa(mesh):
    """Llama-style GQA, H=8 query heads on Hkv=2: heads shard only when both divide by the axis."""
    q, k, v = _qkv(2, 8, 2, 6, 4)
    labels = check(SDPA, q, k, v, enable_gqa=True, mesh=mesh)
    if mesh == (2,):
        has(labels, "(S(1)) (S(1)) (S(1)) -> (S(1))", "(S(0)) (S(0)) (S(0)) -> (S(0))")
    if mesh == (4,):
        lacks(labels, "(S(1)) (S(1)) (S(1)) -> (S(1))")
    q, k, v = _qkv(2, 6, 3, 6, 4)  # 6 on 2 is even, 3 kv heads are not: groups would straddle ranks
    lacks(check(SDPA, q, k, v, enable_gqa=True, mesh=(2,)), "(S(1)) (S(1)) (S(1)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_sdpa_with_explicit_masks(mesh):
    q, k, v = _qkv(2, 4, 4, 6, 8)
    bool_mask = torch.rand(2, 1, 6, 6) > 0.3
    bool_mask |= torch.eye(6, dtype=torch.bool)  # no fully masked row (would be NaN)
    lb = check(SDPA, q, k, v, bool_mask, mesh=mesh)
    float_mask = rnd(1, 4, 6, 6)
    lf = check(SDPA, q, k, v, float_mask, mesh=mesh)
    l2d = check(SDPA, q, k, v, rnd(6, 6), 0.0, False, scale=0.3, mesh=mesh)
    if mesh == (2,):
        has(
            lb,
            "(S(0)) (S(0)) (S(0)) (S(0)) -> (S(0))",
            "(S(1)) (S(1)) (S(1)) (R) -> (S(1))",
            "(S(2)) (R) (R) (S(2)) -> (S(2))",
        )
        has(
            lf,
            "(S(0)) (S(0)) (S(0)) (R) -> (S(0))",
            "(S(1)) (S(1)) (S(1)) (S(1)) -> (S(1))",
            "(S(2)) (R) (R) (S(2)) -> (S(2))",
        )
        has(l2d, "(S(2)) (R) (R) (S(0)) -> (S(2))", "(S(0)) (S(0)) (S(0)) (R) -> (S(0))")
    if mesh == (2, 2):
        has(lb, "(S(0),S(2)) (S(0),R) (S(0),R) (S(0),S(2)) -> (S(0),S(2))")


# ----------------------------------------------------------------------------- factories


@pytest.mark.parametrize("mesh", MESHES)
def test_factories_are_replicated_not_fallback(mesh):
    rr = "(" + ",".join("R" * len(mesh)) + ")"
    for target, args, kwargs in [
        (aten.arange.default, (16,), {}),
        (aten.arange.start, (2, 16), {}),
        (aten.arange.start_step, (0, 16, 3), {}),
        (aten.zeros.default, ([3, 4],), {}),
        (aten.ones.default, ([3, 4],), {"dtype": torch.bool}),
        (aten.full.default, ([2, 3], 1.5), {}),
        (aten.scalar_tensor.default, (-1.0,), {}),
    ]:
        assert check(target, *args, mesh=mesh, **kwargs) == {" -> " + rr}, target


def test_empty_factories_offer_replicate_only():
    """Uninitialized values cannot be compared; check the strategy lists instead."""
    x = rnd(4, 6)
    for target, args in [
        (aten.empty.memory_format, ([3, 4],)),
        (aten.new_empty.default, (x, [3])),
        (aten.empty_like.default, (x,)),
    ]:
        call, _ = make_call(target, args)
        strategies = expand_to_mesh(call, (2,), rule_for(target))
        assert strategies and not any(s.fallback for s in strategies)
        assert all(s.outputs[0] == (R,) or s.outputs[0] == s.inputs[0] for s in strategies), target


@pytest.mark.parametrize("mesh", MESHES)
def test_new_and_like_factories(mesh):
    x = rnd(4, 6)
    ln = check(aten.new_ones.default, x, [3], mesh=mesh)
    check(aten.new_zeros.default, x, [2, 2], mesh=mesh)
    check(aten.new_full.default, x, [5], 7.0, mesh=mesh)
    check(aten.new_ones.default, rnd(1, 1, 16, 1), [], dtype=torch.bool, mesh=mesh)  # GPT-2's mask seed
    lz = check(aten.zeros_like.default, torch.randint(0, 5, (6, 5)), mesh=mesh)  # cross-entropy's t' fill
    check(aten.ones_like.default, x, mesh=mesh)
    lf = check(aten.full_like.default, x, 3.0, mesh=mesh)
    if mesh == (2,):
        # only the dtype is read: any input placement, output replicated
        has(ln, "(S(0)) -> (R)", "(S(1)) -> (R)", "(P(sum)) -> (R)", "(P(max)) -> (R)")
        has(lz, "(S(0)) -> (S(0))", "(S(1)) -> (S(1))")
        has(lf, "(S(1)) -> (S(1))", "(P(sum)) -> (R)")


# ----------------------------------------------------------------------------- coverage


MY_MODULES = {f"autopar.strategies.{m}" for m in ("views", "embedding", "attention", "factories")}
VALIDATED = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.transpose.int,
    aten.swapaxes.default,
    aten.swapdims.default,
    aten.t.default,
    aten.permute.default,
    aten.numpy_T.default,
    aten.mT.default,
    aten.movedim.int,
    aten.movedim.intlist,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.unbind.int,
    aten.cat.default,
    aten.concat.default,
    aten.concatenate.default,
    aten.stack.default,
    aten.repeat.default,
    aten.repeat_interleave.self_int,
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.pad.default,
    aten.constant_pad_nd.default,
    aten.embedding.default,
    aten.gather.default,
    aten.index_select.default,
    aten.index.Tensor,
    aten._unsafe_index.Tensor,
    aten.index_put.default,
    aten.scatter.value,
    aten.scatter.src,
    aten.scatter_add.default,
    aten.reshape_as.default,
    aten.view_as.default,
    SDPA,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
}


def test_every_op_of_these_families_is_validated_here():
    mine = {t for t in registered_targets() if rule_for(t).__module__ in MY_MODULES}
    assert mine == VALIDATED, (
        f"registered but not tested: {mine - VALIDATED}; tested but not registered: {VALIDATED - mine}"
    )
    assert {"masked_embedding", "masked_gather", "masked_index_select"} <= set(KERNELS)
