"""rstar: the intrinsic rank r* of attention tasks, estimated from data alone."""

__version__ = "0.1.0"
