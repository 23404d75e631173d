"""English text that ships with Python (module docstrings), cut into token windows: no download."""

import importlib
import importlib.util
import inspect
import os
import sysconfig
import warnings

import numpy as np

__all__ = ["stdlib_text", "text_windows", "token_windows"]

#: Standard-library modules whose documentation is the default text (prose-heavy, stable across versions).
TEXT_MODULES = ("argparse", "asyncio", "collections", "csv", "datetime", "decimal", "difflib", "email", "enum",
                "fractions", "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging",
                "multiprocessing", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
                "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
                "urllib.parse", "uuid", "warnings", "zipfile", "abc", "ast", "bisect", "calendar", "codecs",
                "configparser", "contextlib", "copy", "dataclasses", "doctest", "fnmatch", "ftplib", "getopt",
                "gettext", "glob", "gzip", "hashlib", "hmac", "imaplib", "io", "ipaddress", "locale", "mailbox",
                "numbers", "operator", "optparse", "platform", "poplib", "pprint", "queue", "sched", "selectors",
                "shelve", "shlex", "smtplib", "struct", "tempfile", "timeit", "tokenize", "trace", "traceback",
                "types", "weakref", "wave", "xml.dom.minidom", "zipimport")


def _is_standard_library(name):
    """Whether ``name`` resolves to the standard library's own module (built in, frozen, or under its folder)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    root = os.path.realpath(sysconfig.get_paths()["stdlib"])
    return os.path.realpath(spec.origin).startswith(root + os.sep)


def stdlib_text(modules=TEXT_MODULES):
    """The docstrings of the given standard-library modules and of their public classes and functions, as one
    string of English prose (deterministic for a Python version)."""
    parts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            if not _is_standard_library(name):
                continue   # missing, or shadowed by a file of the same name on sys.path (a user's trace.py)
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            parts.append(inspect.getdoc(mod) or "")
            for attr in sorted(vars(mod)):
                if attr.startswith("_"):
                    continue
                obj = getattr(mod, attr)
                if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name:
                    parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def token_windows(token_ids, seq_len, n_samples, *, random_state=None, prefix=(), suffix=()):
    """``n_samples`` windows of ``seq_len`` consecutive tokens from one long token sequence, shape (n, seq_len).

    Windows start at distinct random offsets (without replacement while there are enough); ``prefix`` and
    ``suffix`` token ids (e.g. BERT's ``[CLS]`` and ``[SEP]``) are placed around each and count in ``seq_len``.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    if isinstance(n_samples, bool) or not isinstance(n_samples, (int, np.integer)) or n_samples < 1:
        raise ValueError(f"n_samples must be an integer >= 1 (token windows), got {n_samples!r}.")
    body = seq_len - len(prefix) - len(suffix)
    if body < 1:
        raise ValueError(f"seq_len={seq_len} leaves no room for text between the prefix and suffix.")
    starts_available = ids.size - body + 1
    if starts_available < 1:
        raise ValueError(f"the text has {ids.size} tokens, fewer than a window of {body}.")
    rng = np.random.default_rng(random_state)
    starts = rng.choice(starts_available, size=n_samples, replace=n_samples > starts_available)
    win = ids[starts[:, None] + np.arange(body)]
    cols = [np.broadcast_to(np.asarray(prefix, dtype=np.int64), (n_samples, len(prefix))), win,
            np.broadcast_to(np.asarray(suffix, dtype=np.int64), (n_samples, len(suffix)))]
    return np.ascontiguousarray(np.concatenate(cols, axis=1))


def text_windows(tokenizer, seq_len, n_samples, *, text=None, random_state=None):
    """:func:`token_windows` over ``text`` (default :func:`stdlib_text`) tokenised by a Hugging Face
    ``tokenizer``, framed by its ``[CLS]`` and ``[SEP]`` tokens where it has them, shape (n_samples, seq_len)."""
    # the text is tokenised as one long sequence and cut into windows afterwards: no window passes the model
    # longer than seq_len, so the tokenizer's "longer than the maximum sequence length" warning is not for us
    ids = tokenizer(stdlib_text() if text is None else text, add_special_tokens=False, verbose=False)["input_ids"]
    frame = {key: [] if tok is None else [tok] for key, tok in (("prefix", tokenizer.cls_token_id),
                                                                 ("suffix", tokenizer.sep_token_id))}
    return token_windows(ids, seq_len, n_samples, random_state=random_state, **frame)
