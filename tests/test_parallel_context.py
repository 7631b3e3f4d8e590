"""Rank grid arithmetic (no backend), live process groups, collective wrappers and the comm ledger."""

from __future__ import annotations

import pytest
import torch

from megazero.distributed.context import GROUP_KINDS, ParallelContext, RankGrid, TopologyError, node_split
from megazero.distributed.launch import _first_slurm_host, detect_env
from megazero.distributed.ledger import CommLedger
from tests.dist import WorldError, run_world


def test_grid_layout_tp_fastest_then_dp_then_pp():
    g = RankGrid(16, tp_size=2, pp_size=2, dp_size=4)
    assert [g.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert g.coords(8) == (1, 0, 0) and g.coords(15) == (1, 3, 1)
    assert all(g.rank_of(*g.coords(r)) == r for r in range(16))
    assert g.tp_groups()[0] == [0, 1]
    assert g.dp_groups()[0] == [0, 2, 4, 6] and g.dp_groups()[-1] == [9, 11, 13, 15]
    assert g.pp_groups()[0] == [0, 8]
    assert g.mp_groups()[1] == [2, 3, 10, 11]
    assert g.embedding_groups()[0] == [0, 8]
    for kind in ("tp", "dp", "pp", "mp", "embedding"):  # every kind partitions the world
        groups = getattr(g, f"{kind}_groups")()
        assert sorted(r for grp in groups for r in grp) == list(range(16)), kind
    assert RankGrid(4, dp_size=4).embedding_groups() == [[0], [1], [2], [3]]


# which coordinates vary inside a group of each kind (the others are shared by all its members)
VARIES = {"tp": "t", "cp": "c", "dp": "d", "dp_cp": "dc", "pp": "p", "mp": "pt", "embedding": "p"}
SHAPES = [(1, 4, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (2, 2, 2, 2), (4, 2, 1, 2), (1, 2, 3, 2), (2, 1, 2, 2)]


@pytest.mark.parametrize("tp, cp, dp, pp", SHAPES)
def test_grid_with_cp_orders_tp_then_cp_then_dp_then_pp(tp, cp, dp, pp):
    g = RankGrid(tp * cp * dp * pp, tp, pp, dp, cp_size=cp)
    letters = "pdct"
    for r in range(g.world_size):
        p_, d, c, t = pos = g.position(r)
        assert r == ((p_ * dp + d) * cp + c) * tp + t and g.rank_of(p_, d, t, c) == r
        assert g.coords(r) == (p_, d, t)
        for kind in GROUP_KINDS:  # the group of r: shared coordinates fixed, the varying ones all present
            members = g.group_of(kind, r)
            assert r in members and members == sorted(members)
            for m in members:
                assert all(a == b for a, b, k in zip(g.position(m), pos, letters) if k not in VARIES[kind]), kind
            sizes = {"p": pp, "d": dp, "c": cp, "t": tp}
            expect = 2 if kind == "embedding" and pp > 1 else 1 if kind == "embedding" else None
            if expect is None:
                expect = 1
                for k in VARIES[kind]:
                    expect *= sizes[k]
            assert len(members) == expect, (kind, members)
    for kind in GROUP_KINDS:  # every rank in exactly one group of each kind (pp <= 2: no middle stages)
        groups = getattr(g, f"{kind}_groups")()
        assert sorted(r for grp in groups for r in grp) == list(range(g.world_size)), kind
    for grp in g.tp_groups():  # TP contiguous, and a TP x CP block too
        assert grp == list(range(grp[0], grp[0] + tp))
    for grp in g.cp_groups():
        assert grp == list(range(grp[0], grp[0] + cp * tp, tp))
    if cp == 1:  # the three-dimensional grid, unchanged
        assert g.dp_cp_groups() == g.dp_groups() and g.cp_groups() == [[r] for r in range(g.world_size)]


def test_grid_with_cp_concrete_layout():
    g = RankGrid.from_world(16, tp_size=2, pp_size=2, cp_size=2)  # dp derived: 2
    assert g.dp_size == 2 and g.position(5) == (0, 1, 0, 1) and g.position(6) == (0, 1, 1, 0)
    assert g.tp_groups()[:2] == [[0, 1], [2, 3]]
    assert g.cp_groups()[:2] == [[0, 2], [1, 3]]
    assert g.dp_groups()[:2] == [[0, 4], [1, 5]]
    assert g.dp_cp_groups()[0] == [0, 2, 4, 6]
    assert g.pp_groups()[0] == [0, 8] and g.mp_groups()[0] == [0, 1, 8, 9]


def test_grid_errors_name_the_fix():
    with pytest.raises(TopologyError, match=r"world size 8 != tp \(2\) x cp \(3\) x pp \(2\) x dp \(1\)"):
        RankGrid(8, 2, 2, 1, cp_size=3)
    with pytest.raises(TopologyError, match=r"not divisible by tp \(2\) x cp \(3\)"):
        RankGrid.from_world(8, tp_size=2, cp_size=3)
    with pytest.raises(TopologyError, match="cp_size must be >= 1"):
        RankGrid(8, 8, cp_size=0)
    with pytest.raises(TopologyError, match=r"world size 8 != tp \(2\) x pp \(2\) x dp \(3\)"):
        RankGrid(8, 2, 2, 3)
    with pytest.raises(TopologyError, match="not divisible by tp"):
        RankGrid.from_world(6, tp_size=4)
    assert RankGrid.from_world(8, tp_size=2, pp_size=2).dp_size == 2


def test_launcher_environment_detection():
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 8, 1, "torchrun")
    env = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                      "SLURM_NODELIST": "gpu[003-004,010]"})
    assert (env.rank, env.world_size, env.master_addr, env.launcher) == (5, 16, "gpu003", "slurm")
    assert _first_slurm_host("node7,node8") == "node7"
    assert detect_env({}).launcher == "single"


def test_ledger_counts_logical_volume_per_step():
    led = CommLedger()
    led.record("dp", "all_reduce", "grad", 20)
    led.record("tp", "all_reduce", "act", 6)
    led.mark_step()
    assert led.dp_volume_last_step() == 20
    led.record("dp", "reduce_scatter", "grad", 10)
    led.record("dp", "all_gather", "param", 10)
    led.record("dp", "all_reduce", "loss", 2)
    led.mark_step()
    assert led.dp_volume_last_step() == 20
    assert led.breakdown_last_step() == {"dp/all_gather/param": 10, "dp/all_reduce/loss": 2,
                                         "dp/reduce_scatter/grad": 10}


def _groups_and_collectives(ctx):
    g = ctx.grid
    out = {"coords": (ctx.pp_rank, ctx.dp_rank, ctx.tp_rank)}
    assert (ctx.pp_rank, ctx.dp_rank, ctx.cp_rank, ctx.tp_rank) == g.position(ctx.rank)
    assert ctx.coords()["cp_rank"] == ctx.cp_rank and ctx.cp_enabled == (g.cp_size > 1)
    for kind in GROUP_KINDS:
        grp = getattr(ctx, f"{kind}_group")
        assert grp.ranks == g.group_of(kind, ctx.rank) and grp.ranks[grp.rank] == ctx.rank
    x = torch.full((3,), float(ctx.rank))
    ctx.dp_group.all_reduce(x, tag="grad")
    out["dp_sum"] = x[0].item()
    n = ctx.tp_group.size
    gathered = torch.empty(2 * n)
    ctx.tp_group.all_gather_into(gathered, torch.full((2,), float(ctx.rank)), tag="param")
    out["tp_gather"] = gathered.tolist()
    rs = torch.empty(2)
    ctx.dp_group.reduce_scatter(rs, torch.arange(2.0 * ctx.dp_size) + ctx.rank, tag="grad")
    out["dp_rs"] = rs.tolist()
    y = torch.tensor([float(ctx.rank)])
    ctx.pp_group.broadcast(y, src=0)
    out["pp_bcast"] = y.item()
    ctx.ledger.mark_step()
    out["dp_volume"] = ctx.ledger.dp_volume_last_step()
    return out


def test_live_groups_and_collectives_in_an_8_rank_world():
    res = run_world(_groups_and_collectives, 8, tp=2, pp=2)
    grid = RankGrid(8, 2, 2, 2)
    for r, out in enumerate(res):
        assert out["coords"] == grid.coords(r)
        dp_ranks = grid.group_of("dp", r)
        assert out["dp_sum"] == sum(dp_ranks)
        assert out["tp_gather"] == [float(t) for t in grid.group_of("tp", r) for _ in range(2)]
        i = dp_ranks.index(r)
        assert out["dp_rs"] == [float(sum(2 * i + k + q for q in dp_ranks)) for k in range(2)]
        assert out["pp_bcast"] == float(grid.group_of("pp", r)[0])
        # all-reduce of 3 counts 6; reduce-scatter counts its input (4); the tp gather is not DP traffic
        assert out["dp_volume"] == 2 * 3 + 4


def _cp_groups_and_collectives(ctx):
    out = _groups_and_collectives(ctx)
    for kind in ("cp", "dp_cp"):
        x = torch.full((2,), float(ctx.rank))
        getattr(ctx, f"{kind}_group").all_reduce(x)
        out[f"{kind}_sum"] = x[0].item()
    out["names"] = (ctx.cp_group.name, ctx.dp_cp_group.name, ctx.dp_cp_group is ctx.dp_group)
    return out


def test_live_cp_groups_in_a_cp2_dp2_world():
    res = run_world(_cp_groups_and_collectives, 4, cp=2)
    grid = RankGrid(4, dp_size=2, cp_size=2)
    for r, out in enumerate(res):
        assert out["coords"] == grid.coords(r)
        assert out["cp_sum"] == sum(grid.group_of("cp", r)) and out["dp_sum"] == sum(grid.group_of("dp", r))
        assert out["dp_cp_sum"] == 0 + 1 + 2 + 3
        assert out["names"] == ("cp", "dp_cp", False)
        assert out["dp_volume"] == 2 * 3 + 4  # the dp group's traffic, not the cp or dp_cp groups'


def _fails_on_rank_one(ctx):
    if ctx.rank == 1:
        raise RuntimeError("boom on rank one")
    torch.distributed.barrier()  # would wait forever for rank 1 without the harness stopping the world


def test_harness_reports_a_failing_rank_instead_of_hanging():
    with pytest.raises(WorldError, match="boom on rank one"):
        run_world(_fails_on_rank_one, 2, timeout=60)


def _peer_goes_missing(ctx):
    import time

    if ctx.rank == 1:
        time.sleep(7)  # alive but never joins the collective
        return "absent"
    start = time.monotonic()
    try:
        ctx.world_group.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - the timeout is what we want to see
        return ("error", time.monotonic() - start, type(e).__name__)
    return ("completed", time.monotonic() - start, "")


def test_collective_timeout_turns_a_missing_peer_into_an_error():
    res = run_world(_peer_goes_missing, 2, dist_timeout=2, timeout=60)
    status, seconds, _ = res[0]
    # an error, not a completion once the peer wakes at 7 s; no lower bound on wall time (shared machines),
    # an upper bound of 3x the 2 s timeout it checks
    assert status == "error" and seconds < 3 * 2, res[0]


def test_node_split_groups_and_errors():
    # dp 8 over 2 nodes of 4: intra = each node's ranks, inter = equal positions, hpz blocks of 2
    intra, inter, hpz = node_split(list(range(8)), 4, 2)
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hpz == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # tp 2 x dp 4 on nodes of 4: the DP group of tp rank 1 holds 2 ranks per node
    assert node_split([1, 3, 5, 7], 4) == ([[1, 3], [5, 7]], [[1, 5], [3, 7]], [[1], [3], [5], [7]])
    # tp 8 across nodes of 4: every DP member on its own node
    assert node_split([0, 8], 4)[:2] == ([[0], [8]], [[0, 8]])
    with pytest.raises(TopologyError, match=r"--zero-hpz-partition-size 3 does not divide the 4 ZeRO"):
        node_split(list(range(8)), 4, 3)
    with pytest.raises(TopologyError, match=r"holds \[2, 1\] ranks on its nodes"):
        node_split([0, 1, 2], 2)


def test_ledger_counts_bytes_by_link_and_node_share():
    led = CommLedger(ranks_per_node=4, rank=1)
    led.record("dp", "all_gather", "param", 100, 200, ranks=list(range(8)))  # spans nodes: inter, share 200/4
    led.record("dp.intra", "all_gather", "param", 100, 200, ranks=[0, 1, 2, 3])  # inside node 0
    led.record("dp.inter", "all_to_all", "grad", 10, 5, ranks=[1, 5])  # one member per node: share 5
    led.record("dp", "all_reduce", "loss", 2, 8, ranks=list(range(8)))
    led.mark_step()
    assert led.link_bytes_last_step(("grad", "param")) == {"intra": 200, "inter": 205}
    assert led.link_bytes_last_step() == {"intra": 200, "inter": 213}
    assert led.node_share_last_step(("grad", "param")) == 200 / 4 + 5
    assert led.dp_volume_last_step() == 210  # the node subgroups count as the ZeRO group
    assert led.link_breakdown_last_step()["dp.inter/all_to_all/grad/inter"] == 5
    one_node = CommLedger()  # no node size: everything is intra-node
    one_node.record("dp", "all_gather", "param", 4, 8, ranks=[0, 1])
    one_node.mark_step()
    assert one_node.link_bytes_last_step() == {"intra": 8, "inter": 0}


def _node_groups(ctx):
    a = ctx.configure_nodes(2, 2)  # dp 4 on 2 nodes of 2
    again = ctx.configure_nodes(2, 2)
    out = {"same": again is a, "hpz_is_intra": a.hpz is a.intra, "ranks": (a.intra.ranks, a.inter.ranks),
           "names": (a.intra.name, a.inter.name), "attached": ctx.dp_group.nodes is a}
    x = torch.ones(2)
    a.inter.all_reduce(x, tag="grad")
    ctx.ledger.mark_step()
    out["bytes"] = ctx.ledger.link_bytes_last_step()
    one = ctx.configure_nodes(4)  # one node: intra is the DP group itself, no new communicator
    out["one_node"] = (one.intra is ctx.dp_group, one.inter.size, one.hpz.size)
    sub = ParallelContext.from_grid(RankGrid.from_world(4, tp_size=2))  # dp 2, one DP rank per node of 2
    nodes = sub.configure_nodes(2)
    out["tp2"] = (nodes.inter is sub.dp_group, nodes.intra.size)
    try:
        ctx.configure_nodes(3)
    except TopologyError as e:
        out["error"] = str(e)
    return out


def test_configure_nodes_splits_the_zero_group_once():
    res = run_world(_node_groups, 4)
    for rank, r in enumerate(res):
        assert r["same"] and r["hpz_is_intra"] and r["attached"]
        node = rank // 2
        assert r["ranks"] == ([2 * node, 2 * node + 1], [rank % 2, rank % 2 + 2])
        assert r["names"] == ("dp.intra", "dp.inter")
        assert r["bytes"] == {"intra": 0, "inter": 2 * 2 * 4}  # all-reduce of 2 fp32: 2n elements, 4 bytes each
        assert r["one_node"] == (True, 1, 1)
        assert r["tp2"] == (True, 1)
        assert "--ranks-per-node 3 does not divide the world size 4" in r["error"]
