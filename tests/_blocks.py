"""A transformer block's output error under a rank plan, measured by hand (forward hooks on the whole model): what
Eigen Attention's sweep must reproduce from the block's inputs alone."""

import torch


def block_error_by_hand(model, block, ids, plan, layers, metric="activations"):
    """``||B(x) - B_plan(x)|| / ||B(x)||`` for the block ``block`` over the windows ``ids``, its heads cut by
    ``truncated_heads(model, plan, layers, metric=metric)``, both runs of the full model."""
    from rstar.heads import truncated_heads

    got = []
    handle = block.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            model(torch.as_tensor(ids))
            with truncated_heads(model, plan, layers, metric=metric):
                model(torch.as_tensor(ids))
    finally:
        handle.remove()
    return float((got[0] - got[1]).norm() / got[0].norm())
