"""Collectives: values equal the definition; ledger bytes equal the ring formulas exactly,
and picolib's own rings send exactly what the formulas say (counted from real sends)."""
import pytest
import torch
import torch.distributed as dist

from picolib.comm import (Ledger, all_gather, all_reduce, all_to_all, broadcast, exchange,
                          reduce_scatter, ring_all_gather, ring_all_reduce,
                          ring_reduce_scatter, ring_sent_bytes)
from picolib.launch import run

N_EL = 96  # divides by 2, 3, 4, 8


def every_collective(n_el):
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(n_el, dtype=torch.float32) * (r + 1)
    total = torch.arange(n_el, dtype=torch.float32) * (n * (n + 1) // 2)
    got = {}
    with Ledger() as led:
        got["ring_all_reduce"] = ring_all_reduce(x.clone())
        got["ring_reduce_scatter"] = ring_reduce_scatter(x.clone())
        got["ring_all_gather"] = ring_all_gather(total.chunk(n)[r])
        y = x.clone(); all_reduce(y); got["all_reduce"] = y
        o = torch.empty(n_el // n); reduce_scatter(o, x.clone()); got["reduce_scatter"] = o
        g = torch.empty(n_el); all_gather(g, total.chunk(n)[r].clone()); got["all_gather"] = g
        b = x.clone(); broadcast(b, src=n - 1); got["broadcast"] = b
        a = torch.empty(n_el); all_to_all(a, x.clone()); got["all_to_all"] = a
        h = all_reduce(x.clone(), op="avg", async_op=True); h.wait()
    expected = {
        "ring_all_reduce": total, "all_reduce": total,
        "ring_reduce_scatter": total.chunk(n)[r], "reduce_scatter": total.chunk(n)[r],
        "ring_all_gather": total, "all_gather": total,
        "broadcast": torch.arange(n_el, dtype=torch.float32) * n,
        "all_to_all": torch.cat([(torch.arange(n_el, dtype=torch.float32) * (j + 1)).chunk(n)[r]
                                 for j in range(n)]),
    }
    wrong = [k for k in expected if not torch.equal(got[k], expected[k])]
    return wrong, led.as_dicts()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_values_and_ledger_bytes_equal_the_ring_formulas(n):
    B = N_EL * 4
    for rank, (wrong, records) in enumerate(run(every_collective, n, N_EL)):
        assert wrong == []
        ops = [(r["op"], r["measured"]) for r in records]
        assert ops == [("all_reduce", True), ("reduce_scatter", True), ("all_gather", True),
                       ("all_reduce", False), ("reduce_scatter", False), ("all_gather", False),
                       ("broadcast", False), ("all_to_all", False), ("all_reduce", False)]
        for rec in records:
            assert rec["group_size"] == n and rec["nbytes"] == B
            assert rec["seconds"] is not None and rec["seconds"] >= 0
        sent = [r["sent_bytes"] for r in records]
        # counted from the sends of picolib's rings: exactly the textbook formulas
        assert sent[0] == 2 * (n - 1) * B // n
        assert sent[1] == sent[2] == (n - 1) * B // n
        assert sent[3:6] == sent[0:3]
        assert sent[6] == (0 if rank == n - 2 else B)  # chain from rank n-1: rank n-2 is last
        assert sent[7] == (n - 1) * B // n


def test_ring_formulas():
    B = 1200
    assert ring_sent_bytes("all_reduce", B, 4) == 1800
    assert ring_sent_bytes("reduce_scatter", B, 4) == ring_sent_bytes("all_gather", B, 4) == 900
    assert ring_sent_bytes("all_reduce", B, 1) == 0
    assert [ring_sent_bytes("broadcast", B, 4, rank=r, root=1) for r in range(4)] == [0, B, B, B]  # rank 0 ends the chain 1→2→3→0
    with pytest.raises(ValueError, match="unknown"):
        ring_sent_bytes("all_scatter", B, 4)


def subgroup_and_p2p():
    r = dist.get_rank()
    pair = dist.new_group([1, 2])
    out = None
    with Ledger() as led:
        if r in (1, 2):
            t = torch.full((8,), float(r))
            ring_all_reduce(t, group=pair)
            out = t
        nxt, prv = (r + 1) % 4, (r - 1) % 4
        got = torch.empty(3)
        exchange(sends=[(torch.full((3,), float(r)), nxt)], recvs=[(got, prv)])
    return out, got, led.summary()


def test_subgroups_and_batched_send_recv():
    res = run(subgroup_and_p2p, 4)
    for r, (out, got, summary) in enumerate(res):
        assert torch.equal(got, torch.full((3,), float((r - 1) % 4)))
        assert summary["send"]["sent_bytes"] == 12 and summary["recv"]["sent_bytes"] == 0
        if r in (1, 2):
            assert torch.equal(out, torch.full((8,), 3.0))
            assert summary["all_reduce"]["sent_bytes"] == 32  # 2·(2−1)/2 · 32 bytes
        else:
            assert out is None and "all_reduce" not in summary


def uneven_ring():
    ring_reduce_scatter(torch.ones(10))


def test_ring_rejects_sizes_that_do_not_divide():
    from picolib.launch import WorkerError
    with pytest.raises(WorkerError, match="do not divide"):
        run(uneven_ring, 4)


def test_ledgers_nest_and_close():
    outer, inner = Ledger(), Ledger()
    from picolib.comm import Record
    with outer:
        with inner:
            Ledger._add(Record("send", 2, 4, 4, 0.0))
        Ledger._add(Record("send", 2, 4, 4, 0.0))
    Ledger._add(Record("send", 2, 4, 4, 0.0))  # no ledger open: recorded nowhere
    assert inner.count() == 1 and outer.count() == 2 and outer.total() == 8


def isend_in_order():
    from picolib.comm import isend
    r = dist.get_rank()
    if r == 0:
        with Ledger() as led:
            works = [isend(torch.full((5,), float(i)), 1) for i in range(3)]
            for w in works:
                w.wait()
        return led.count("send"), led.total()
    got = []
    for _ in range(3):
        b = torch.empty(5)
        dist.recv(b, 0)
        got.append(b[0].item())
    return got


def test_isend_returns_at_once_and_keeps_order():
    sent, received = run(isend_in_order, 2)
    assert sent == (3, 3 * 5 * 4) and received == [0.0, 1.0, 2.0]


def irecv_ahead():
    from picolib.comm import irecv
    r = dist.get_rank()
    if r == 0:
        dist.barrier()                               # rank 1 has posted all three receives
        for i in range(3):
            dist.send(torch.full((5,), float(i)), 1)
        return None
    bufs = [torch.empty(5) for _ in range(3)]
    with Ledger() as led:
        works = [irecv(b, 0) for b in bufs]
    dist.barrier()
    for w in reversed(works):
        w.wait()
    return [b[0].item() for b in bufs], led.count("recv"), led.total("nbytes")


def test_irecv_posted_ahead_takes_messages_in_order():
    _, (got, calls, nbytes) = run(irecv_ahead, 2)
    assert got == [0.0, 1.0, 2.0] and calls == 3 and nbytes == 3 * 5 * 4


# ------------------------------------------- Ledger(rings=True): the traffic counted as sent

def routed_collectives(n_el, sizes):
    """The same calls native and on the rings (uneven and tiny sizes, sum/avg/max, a subgroup,
    async): values must agree; the rings' records are measured=True."""
    from picolib.comm import NotMeasured
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for rings in (False, True):
        got = []
        with Ledger(rings=rings) as led:
            for size in sizes:                                  # all-reduce of any size
                for op in ("sum", "avg", "max"):
                    t = torch.arange(size, dtype=torch.float32) * (r + 1) - r
                    all_reduce(t, op=op); got.append(t)
            x = torch.arange(n * n_el, dtype=torch.float32) * (r + 1)
            o = torch.empty(n_el); reduce_scatter(o, x, op="avg"); got.append(o)
            assert torch.equal(x, torch.arange(n * n_el, dtype=torch.float32) * (r + 1))  # untouched
            g = torch.empty(n * n_el)
            h = all_gather(g, torch.full((n_el,), float(r)), async_op=True); h.wait(); got.append(g)
            pair = dist.new_group([0, 1])
            if r in (0, 1):
                p = torch.full((6,), float(r + 1)); all_reduce(p, group=pair); got.append(p)
        out[rings] = (got, led.as_dicts())
        if rings:
            out["total"] = led.measured_total()
        else:
            try:
                led.measured_total()
                out["refused"] = False
            except NotMeasured:
                out["refused"] = True
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_ledger_on_rings_counts_what_it_sends_and_equals_native(n):
    sizes = [1, 3, 7, 96]                                       # fewer elements than ranks, uneven
    for r, out in enumerate(run(routed_collectives, n, 5, sizes)):
        (native, nrecs), (rings, rrecs) = out[False], out[True]
        assert len(native) == len(rings)
        for a, b in zip(native, rings):
            assert torch.allclose(a, b, atol=1e-5)
        assert all(not x["measured"] for x in nrecs) and all(x["measured"] for x in rrecs)
        assert [x["op"] for x in nrecs] == [x["op"] for x in rrecs]
        assert out["refused"] is True                           # computed bytes refused as measured
        # counted: reduce-scatter sends every chunk but this rank's, all-gather every chunk but
        # its right neighbour's; uneven sizes differ from the formula by the rounding
        for rec in rrecs:
            k, me = rec["group_size"], rec["ranks"].index(r)
            chunks = [len(c) for c in torch.tensor_split(torch.empty(rec["nbytes"] // 4), k)]
            rs, ag = sum(chunks) - chunks[me], sum(chunks) - chunks[(me + 1) % k]
            want = {"all_reduce": rs + ag, "reduce_scatter": rs, "all_gather": ag}[rec["op"]]
            assert rec["sent_bytes"] == 4 * want, rec
        even = [x for x in rrecs if (x["nbytes"] // 4) % x["group_size"] == 0]
        for rec in even:                                        # even sizes: the textbook formula
            assert rec["sent_bytes"] == ring_sent_bytes(rec["op"], rec["nbytes"], rec["group_size"])
        assert out["total"] == sum(x["sent_bytes"] for x in rrecs)


def test_measured_total_refuses_computed_records():
    from picolib.comm import NotMeasured, Record, measured_total
    with Ledger() as led:
        Ledger._add(Record("all_reduce", 2, 8, 8, 0.0, measured=True))
        Ledger._add(Record("broadcast", 2, 8, 8, 0.0, measured=False))
    assert led.measured_total(op="all_reduce") == 8
    assert measured_total(led.as_dicts(), op="all_reduce") == 8
    with pytest.raises(NotMeasured, match="broadcast"):
        led.measured_total()
    with pytest.raises(NotMeasured):
        measured_total(led.as_dicts())
