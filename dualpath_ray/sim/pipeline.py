"""How long a layerwise prefill batch takes: the runtime's 3-slot pipeline in closed form.

runtime/prefill/pipeline.py runs a batch of L layers as

    post_in(0), post_in(1)
    for l in 0..L-1:  finish_in(l); compute(l); post_out(l); finish_out(l-1); post_in(l+2)

Loads share the engine's CNIC receive side, sends its transmit side, so each kind runs one at a
time. With per-layer times a (load), c (compute) and s (send), layer l's load is posted at
P_l = 0 for l < 2, c_0 for l = 2, and max(c_{l-2}, o_{l-3}) after, and

    i_l = max(P_l, i_{l-1}) + a      (its past KV has landed)
    c_l = max(c_{l-1}, i_l) + c      (computed)
    o_l = max(c_l, o_{l-1}) + s      (its KV has left)

The batch ends at o_{L-1}. These max-plus recurrences become periodic after a few layers (each
time advances by max(a, c, s) per layer: the window of 3 never binds, since a + c + s <= 3 *
max(a, c, s)), so they are iterated until two layers in a row advance all three by the same
step, and the rest is extrapolated: exact, and O(1) for a 61-layer model.

Without layerwise prefill (the ablation's baseline) every layer's past KV is loaded before the
first layer computes: L * a, then compute and send pipelined as above with nothing to load.
"""

from __future__ import annotations


def layerwise_seconds(n_layer: int, load: float, compute: float, send: float) -> float:
    """End of a batch of n_layer layers whose per-layer load, compute and send take these times."""
    if n_layer <= 0:
        return 0.0
    loaded: list[float] = []
    computed: list[float] = []
    sent: list[float] = []
    previous_step = (-1.0, -1.0, -1.0)
    steady = 0
    for layer in range(n_layer):
        if layer < 2:
            posted = 0.0
        elif layer == 2:
            posted = computed[0]
        else:
            posted = max(computed[layer - 2], sent[layer - 3])
        loaded.append(max(posted, loaded[-1] if loaded else 0.0) + load)
        computed.append(max(computed[-1] if computed else 0.0, loaded[-1]) + compute)
        sent.append(max(computed[-1], sent[-1] if sent else 0.0) + send)
        if layer >= 3:
            step = (loaded[-1] - loaded[-2], computed[-1] - computed[-2], sent[-1] - sent[-2])
            uniform = _same(step, (step[2], step[2], step[2]))
            steady = steady + 1 if uniform and _same(step, previous_step) else 0
            previous_step = step
            if steady >= 2:
                return sent[-1] + (n_layer - 1 - layer) * step[2]
    return sent[-1]


def _same(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    return all(abs(x - y) <= 1e-12 * max(1.0, abs(x)) for x, y in zip(a, b))


def batch_seconds(n_layer: int, load: float, compute: float, send: float, layerwise: bool = True) -> float:
    """A whole batch: layerwise (the runtime's), or every load before the first layer computes."""
    if layerwise:
        return layerwise_seconds(n_layer, load, compute, send)
    return n_layer * load + layerwise_seconds(n_layer, 0.0, compute, send)
