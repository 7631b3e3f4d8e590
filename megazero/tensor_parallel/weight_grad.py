"""The split backward of the zero-bubble pipeline schedules: B (input gradient) now, W (weight gradients) later.

Zero-bubble schedules (Qi et al., arXiv 2401.10241) run a stage's backward as two actions. **B** produces the
gradient of the stage input, which the previous stage waits for; **W** produces the weight gradients, which
nobody downstream waits for, so the schedule places it in a slot where the rank would otherwise idle.

The mechanism is torch's autograd plus one store per pipeline rank (:class:`WeightGradStore`), with no second
model and no second graph:

* **B** is ``torch.autograd.grad(output, inputs=[stage input, *parameters])`` while the store is *deferring*.
  The linears' and the embeddings' autograd Functions (``layers._ColumnLinear``, ``_Linear``, ``_Embedding``:
  every GEMM weight and every embedding table, the tied LM head included) find the store on their weight
  (``weight.wgrad_store``) and, instead of computing the weight gradient, file a closure over what it needs
  (the layer input and the output gradient; the ids for an embedding) and return None for the weight: autograd
  skips the GEMM. The TP collective of the input gradient runs in B (it is on the critical path); under
  sequence parallelism the all-gather of the layer input, needed only for the weight gradient, runs in W.
  Every other parameter (LayerNorm/RMSNorm weights, biases outside the linears, the learned position table)
  gets its gradient from the same autograd call as an output of ``autograd.grad``, not accumulated: small
  tensors kept until W. Nothing reaches ``.grad`` in B, so no ZeRO hook fires there.
* **W** (:func:`weight_gradients`) evaluates the closures and adds the kept gradients parameter by
  parameter, in backward order (the reverse of registration), and hands each sum to autograd on the leaf
  (``torch.autograd.backward(param, grad)``), so ``.grad`` accumulation and ZeRO's post-accumulate hooks run as
  in an ordinary backward: a bucket or a ZeRO-3 unit becomes ready for its reduction when its last W ends.
  W never reads a parameter's value (``dW = g^T x``), so ZeRO-3 gathers nothing for it.
* **Recompute** (full or selective) recomputes inside B; ``recompute._CheckpointFunction`` calls
  :func:`backward_inside` for its inner backward, which does the same split for the parameters inside the
  recomputed function (found by walking its freshly built graph).

The store is reached from the parameters, never from module-level state: autograd may run a backward on a
device thread, where thread- or context-local state would not be seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

__all__ = ["TiedGrad", "WeightGradStore", "WeightWork", "backward_inside", "deferring_store", "input_gradients",
           "weight_gradients"]

# a deferred piece of W: the parameters it produces gradients for, and the closure computing them (None entries
# in its result: no gradient for that parameter)
Deferred = tuple[tuple[nn.Parameter | None, ...], Callable[[], Sequence[torch.Tensor | None]]]


class WeightWork:
    """What one B left for its W: the deferred closures and the gradients B computed but did not accumulate."""

    def __init__(self) -> None:
        self.deferred: list[Deferred] = []
        self.kept: list[tuple[nn.Parameter, torch.Tensor]] = []

    def stashed_tensors(self) -> list[torch.Tensor]:
        """The tensors this W holds (closure cells and kept gradients), for memory accounting in tests."""
        out = [g for _, g in self.kept]
        for _, fn in self.deferred:
            out += [c.cell_contents for c in (fn.__closure__ or ()) if isinstance(c.cell_contents, torch.Tensor)]
        return out


class WeightGradStore:
    """Collects the deferred weight-gradient work of one pipeline rank's B passes.

    :meth:`attach` marks the parameters whose Functions may defer; :meth:`input_pass` opens a B, during which
    the Functions call :meth:`defer`; it yields the :class:`WeightWork` that B leaves for W.
    """

    open_passes = 0  # B passes open in this process, any store: lets backward_inside skip its graph walk

    def __init__(self) -> None:
        self.deferring = False
        self._work: WeightWork | None = None

    def attach(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            p.wgrad_store = self  # type: ignore[attr-defined]

    @contextmanager
    def input_pass(self) -> Iterator[WeightWork]:
        if self.deferring:
            raise RuntimeError("a B pass started inside another one")
        work = WeightWork()
        self.deferring, self._work = True, work
        WeightGradStore.open_passes += 1
        try:
            yield work
        finally:
            self.deferring, self._work = False, None
            WeightGradStore.open_passes -= 1

    def defer(self, params: tuple[nn.Parameter | None, ...], fn: Callable[[], Sequence[torch.Tensor | None]]) -> None:
        assert self._work is not None, "defer() outside a B pass"
        self._work.deferred.append((params, fn))

    def keep(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
        assert self._work is not None, "keep() outside a B pass"
        self._work.kept += [(p, g) for p, g in zip(params, grads) if g is not None]


class TiedGrad:
    """Where one forward pass's two uses of a tied table (GPT-2's token embedding, also the LM head's weight)
    meet in backward, so that the table's gradient exists once.

    Left to autograd, the head's backward makes its [V, H] weight gradient, autograd holds it until the lookup's
    backward has made a second [V, H] one, then adds the two out of place (torch 2.13 makes a new tensor even
    without grad mode) before AccumulateGrad hands the sum to ZeRO's hook: three tables alive at once, the peak
    of a small-batch step (Megatron-LM's gradient-accumulation fusion avoids the same). Instead the head's
    Function files its weight gradient here (:meth:`put`) and returns none for the weight; the lookup's Function
    adds its rows into that tensor in place (:meth:`take`, ``index_put_(accumulate=True)``: deterministic, and
    no [V, H] zeros) and returns it as the table's only gradient, which AccumulateGrad takes as ``.grad`` without a
    copy (nothing else references it) and the stores' hooks file as before.

    Where the head's GEMM inputs (the logits' gradient [B*S, V] and the input [B*S, H]) are smaller than the
    table, as with short sequences and small batches, the head files the GEMM itself (:meth:`file`) and the lookup's
    backward runs it: between the two, through the blocks' backward, only those inputs are held, not a table.

    Made per forward pass (``GPT.forward``, only where one chunk runs both uses), so a backward that stops before
    the lookup leaves nothing behind for the next pass. A zero-bubble B pass defers both uses to W instead
    (their Functions check the store first), which is unchanged.
    """

    __slots__ = ("grad", "pending")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.pending: Callable[[], torch.Tensor] | None = None  # a deferred weight-gradient GEMM

    def put(self, grad: torch.Tensor) -> None:
        """File a use's weight gradient (a second one is added in place)."""
        self.grad = grad if self.grad is None else self.grad.add_(grad)

    def file(self, gemm: Callable[[], torch.Tensor], kept_numel: int, table_numel: int) -> None:
        """File the weight gradient ``gemm`` computes: run later by :meth:`take` where the ``kept_numel``
        elements its closure holds are fewer than the table's, else now."""
        if kept_numel < table_numel and self.pending is None:
            self.pending = gemm
        else:
            self.put(gemm())

    def take(self) -> torch.Tensor | None:
        """The filed gradient, handed over: this object keeps no reference (so autograd can steal it)."""
        if self.pending is not None:
            gemm, self.pending = self.pending, None
            self.put(gemm())
        grad, self.grad = self.grad, None
        return grad


def deferring_store(param: torch.Tensor | None) -> WeightGradStore | None:
    """The store ``param``'s weight gradient goes to right now: its store while a B pass is open, else None."""
    store = getattr(param, "wgrad_store", None)
    return store if store is not None and store.deferring else None


def has_store(param: torch.Tensor | None) -> bool:
    """Whether ``param`` belongs to a split-backward rank (its layers then run the deferring Functions)."""
    return getattr(param, "wgrad_store", None) is not None


def input_gradients(store: WeightGradStore, output: torch.Tensor | GradientEdge, grad: torch.Tensor | None,
                    inp: torch.Tensor | None, params: Sequence[nn.Parameter]
                    ) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of ``inp`` (None for a first stage) from ``output`` (a loss when ``grad`` is None), and
    the :class:`WeightWork` left for W. ``params`` are the chunk's parameters; those the Functions do not defer
    get their gradient here, kept (a parameter unused in this graph gets none)."""
    want = [inp] if inp is not None else []
    trainable = [p for p in params if p.requires_grad]
    with store.input_pass() as work:
        grads = torch.autograd.grad(output, want + trainable, grad_outputs=grad, allow_unused=True,
                                    materialize_grads=False)
        store.keep(trainable, grads[len(want):])
    return (grads[0] if want else None), work


def weight_gradients(work: WeightWork, order: Sequence[nn.Parameter]) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """W: ``(parameter, gradient)`` for every parameter ``work`` holds a gradient for, in ``order`` (then any
    other), each the sum of its deferred pieces and the gradient B kept. A "parameter" may be a view that stands
    for one (``wgrad_leaf``: K/V rows shared by TP ranks, :func:`~.mappings.sum_shared_rows_grad`); it comes at
    its leaf's place, and autograd takes its gradient through the view's backward to the leaf. The closures run lazily, one parameter
    after another, and each closure's result is dropped once consumed, so at most one closure's gradients and
    the running sum are alive beside what the caller holds."""
    pending: dict[int, list[int]] = {}  # parameter id -> indices of deferred entries producing it
    for i, (ps, _) in enumerate(work.deferred):
        for p in ps:
            if p is not None:
                pending.setdefault(id(p), []).append(i)
    kept: dict[int, list[torch.Tensor]] = {}
    by_id: dict[int, nn.Parameter] = {}
    for p, g in work.kept:
        kept.setdefault(id(p), []).append(g)
        by_id[id(p)] = p
    for ps, _ in work.deferred:
        by_id.update((id(p), p) for p in ps if p is not None)
    # by the leaf's place in ``order``: a view standing for a parameter (``wgrad_leaf``, mappings.
    # sum_shared_rows_grad) takes its parameter's place; the others follow in the order they came
    place = {id(p): i for i, p in enumerate(order)}
    ranked = sorted(by_id, key=lambda k: place.get(id(getattr(by_id[k], "wgrad_leaf", by_id[k])), len(place)))
    results: dict[int, Sequence[torch.Tensor | None]] = {}  # closures evaluated, waiting for their other params
    for key in ranked:
        total: torch.Tensor | None = None
        for i in pending.get(key, []):
            if i not in results:
                results[i] = list(work.deferred[i][1]())
            ps = work.deferred[i][0]
            j = next(k for k, p in enumerate(ps) if p is not None and id(p) == key)
            g = results[i][j]
            results[i][j] = None  # type: ignore[index]
            if all(x is None for x in results[i]):
                del results[i]
            if g is not None:
                total = g if total is None else total + g
        for g in kept.pop(key, []):
            total = g if total is None else total + g
        if total is not None:
            yield by_id[key], total
    work.deferred.clear()
    work.kept.clear()


def _graph_parameters(roots: Sequence[torch.Tensor]) -> list[nn.Parameter]:
    """The parameters (leaves reached through AccumulateGrad nodes) of the graph behind ``roots``."""
    seen, out, stack = set(), [], [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, nn.Parameter):
            out.append(var)
        stack.extend(n for n, _ in node.next_functions)
    return out


def backward_inside(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The backward a recomputation runs inside its node's backward: gradients of ``inputs`` (None where an input
    needs none). In a B pass the parameters inside get theirs through the store (module docstring); otherwise
    this is ``torch.autograd.backward`` into the parameters' ``.grad`` as usual."""
    params = _graph_parameters(outputs) if WeightGradStore.open_passes else []  # the walk only inside a B
    store = next((s for s in map(deferring_store, params) if s is not None), None)
    want = [x for x in inputs if x.requires_grad]
    if store is None:
        torch.autograd.backward(list(outputs), list(grads))
        return [x.grad if x.requires_grad else None for x in inputs]
    got = torch.autograd.grad(list(outputs), want + params, list(grads), allow_unused=True, materialize_grads=False)
    store.keep(params, got[len(want):])
    it = iter(got[: len(want)])
    return [next(it) if x.requires_grad else None for x in inputs]
