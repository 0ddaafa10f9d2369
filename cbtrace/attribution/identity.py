"""Which host events are module calls, and their names, best source first.

(a) ``cbtrace::<fqn>`` ranges from cbtrace's capture: exact paths ("cbtrace::" is the root, fqn
"") and ``cbtrace.copy::<fqn>`` ranges, cbtrace's own overhead; (b) eager ``nn.Module: Class_N``
python_function events (``with_stack=True``), named by their class-and-index chain, or by the real
attribute path when a capture run of the same model is given; (c) user ``record_function``
annotations (a collective's, such as ``nccl:all_reduce``, only in a trace without others:
comm.py); (d) TorchScript ``Module Hierarchy`` args. One source per trace: the best present.
"""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

from cbtrace.attribution import comm
from cbtrace.attribution.forest import Forest, string_mask
from cbtrace.errors import RunDirError

CBTRACE = "cbtrace::"
COPY = "cbtrace.copy::"
NN_MODULE = "nn.Module: "
_NOT_USER = re.compile(r"^(ProfilerStep#\d+|cbtrace(\.copy)?::.*|## .* ##)$")
_USER_CATS = ("user_annotation", "Operator")  # torch 1.9 put record_function under Operator
_HIER_SEG = re.compile(r"^(\w+)\((\w+)\)(?:::\w+)?$")


def choose_source(forest: Forest) -> str | None:
    strings = forest.strings
    names = [strings[c] for c in np.unique(forest.name)]
    if any(n.startswith(CBTRACE) for n in names):
        return "cbtrace"
    if any(n.startswith(NN_MODULE) for n in names):
        return "nn.Module"
    if _user_range_mask(forest).any():
        return "record_function"
    if (forest.hier >= 0).any():
        return "module_hierarchy"
    return None


def _is_user_range(cat: str, name: str) -> bool:
    return cat in _USER_CATS and cat != "cpu_op" and not _NOT_USER.match(name) and (
        cat == "user_annotation" or not name.startswith(("aten::", "autograd::")))


def _user_range_mask(forest: Forest) -> np.ndarray:
    """Per host event: a user ``record_function`` range (judged once per (cat, name) pair).

    A collective's annotation (``nccl:all_reduce``) is an op of the range that issued it, not a
    range of its own, unless the trace has no other range (then it is the best name there is).
    """
    s = forest.strings
    pairs, inv = np.unique(forest.cat.astype(np.int64) * len(s) + forest.name, return_inverse=True)
    ok = np.fromiter((_is_user_range(s[p // len(s)], s[p % len(s)]) for p in pairs), bool,
                     len(pairs))
    is_comm = np.fromiter((comm.is_comm_op(s[p % len(s)]) for p in pairs), bool, len(pairs))
    if (ok & ~is_comm).any():
        ok &= ~is_comm
    return ok[inv.ravel()] if len(pairs) else np.zeros(len(forest), bool)


def labels(forest: Forest, source: str | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Per host event: module label code (-1: not a module call) and is-overhead, + the labels.

    Labels: the fqn of a ``cbtrace::`` range, "Class_N" of an ``nn.Module`` event, a
    record_function name, or the path of a TorchScript module hierarchy.
    """
    s, n = forest.strings, len(forest)
    lab, is_copy, table = np.full(n, -1, np.int64), np.zeros(n, bool), []
    if source in ("cbtrace", "nn.Module"):
        prefix = CBTRACE if source == "cbtrace" else NN_MODULE
        codes = np.full(len(s), -1, np.int64)
        for c, name in enumerate(s):
            if name.startswith(prefix):
                codes[c] = len(table)
                table.append(name[len(prefix):])
        lab = codes[forest.name] if n else lab
        if source == "cbtrace":
            is_copy = string_mask(s, lambda x: x.startswith(COPY))[forest.name] if n else is_copy
        else:
            lab[forest.cat != _code(s, "python_function")] = -1
    elif source == "record_function":
        user = _user_range_mask(forest) & (forest.cat == _code(s, "user_annotation"))
        uniq, inv = np.unique(forest.name[user], return_inverse=True)
        table = [s[c] for c in uniq]
        lab[user] = inv.ravel()
    elif source == "module_hierarchy":
        uniq, inv = np.unique(forest.hier, return_inverse=True)
        paths = [hierarchy_path(s[h]) if h >= 0 else None for h in uniq]
        table = sorted({p for p in paths if p is not None})
        code = np.array([table.index(p) if p is not None else -1 for p in paths], np.int64)
        lab = code[inv.ravel()] if n else lab
        par = forest.parent
        outer = (par < 0) | (forest.hier[par] != forest.hier)  # outermost op of each path
        lab[~outer] = -1
    return lab, is_copy, table


def _code(strings: list, text: str) -> int:
    try:
        return strings.index(text)
    except ValueError:
        return -2


def run_labels(modules_df) -> list[tuple[str, str]]:
    """("Class_N", fqn) of every call of a capture's modules table, in call order.

    The profiler numbers instances of a class in the order it first sees them called; the
    capture records calls in order (call_id), so the N-th distinct fqn of a class is Class_N.
    """
    out, seen = [], {}
    for row in modules_df.sort_values("call_id").itertuples():
        names = seen.setdefault(row.module_type, [])
        if row.fqn not in names:
            names.append(row.fqn)
        out.append((f"{row.module_type}_{names.index(row.fqn)}", row.fqn))
    return out


def class_index_map(modules_df) -> dict[str, str]:
    """"Class_N" -> fqn from a capture's modules table (see ``run_labels``)."""
    return dict(run_labels(modules_df))


def check_capture_run(modules_df, rows, *, run, trace) -> None:
    """Refuse (RunDirError, one line) a capture run that cannot name a trace's nn.Module events.

    ``rows``: the trace's attribution rows (``module_label``, ``source``, ``phase``, ``ts_us``,
    ``depth``). The run's Class_N are right only if the trace first calls the instances of the
    run's classes in the run's order: as many of each class, interleaved the same way. Another
    model fails that, and so does a run captured in part (--max-depth, --include, --exclude)
    that skips an instance of a class it holds, as it numbers only the instances it has.
    Modules of classes the run does not hold (a loss module outside the model) are ignored.
    """
    check_labels(run_labels(modules_df), rows, trace=trace, error=RunDirError,
                 what=f"{run}: its modules", who="the run",
                 hint="name them with a run of the same model captured whole (no --max-depth, "
                      "--include or --exclude)")


def check_labels(calls, rows, *, trace, error, what, who, hint, strict=True) -> None:
    """Refuse (``error``, one line) names ``calls`` (("Class_N", fqn) in first-call order) that
    do not fit the trace's nn.Module events (see check_capture_run).

    ``strict=False``: the order of ``calls`` is not the call order (model_names' declaration
    order), so only the number of instances of each class is compared.
    """
    fwd = rows[(rows["source"] == "nn.Module") & (rows["phase"] == "fwd")]
    if not len(fwd):
        return  # no nn.Module events: nothing to name here
    fqn_of = dict(calls)
    want = list(dict.fromkeys(label for label, _ in calls))
    classes = {label.rpartition("_")[0] for label in want}
    order = fwd.sort_values(["ts_us", "depth"], kind="stable")["module_label"]
    got = [label for label in dict.fromkeys(order) if label.rpartition("_")[0] in classes]
    if not strict:
        detail = _count_mismatch(want, got, who)
    elif got == want:
        return
    else:
        i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b),
                 min(len(got), len(want)))
        if i == len(got):
            detail = f"the trace has no nn.Module event {want[i]} ({fqn_of[want[i]] or '<root>'})"
        elif i == len(want):
            cls = got[i].rpartition("_")[0]
            n_want, n_got = (sum(x.rpartition("_")[0] == cls for x in xs) for xs in (want, got))
            detail = f"the trace has {n_got} {cls} modules, {who} {n_want}"
        else:
            detail = (f"{who} calls {want[i]} ({fqn_of[want[i]] or '<root>'}) where the trace "
                      f"calls {got[i]}")
    if detail is None:
        return
    raise error(f"{what} do not match the nn.Module events of {trace} ({detail}); {hint}")


def _count_mismatch(want, got, who) -> str | None:
    """The first class with another number of instances in the trace than in ``want``."""
    n_want, n_got = (Counter(x.rpartition("_")[0] for x in xs) for xs in (want, got))
    for cls in n_want:
        if n_want[cls] != n_got[cls]:
            return f"the trace has {n_got[cls]} {cls} modules, {who} {n_want[cls]}"
    return None


def hierarchy_path(text: str) -> str | None:
    """TorchScript "TOP(Net)::forward.layer1(Sequential)::forward.0(Block)::forward" -> "layer1.0"."""
    if not text:
        return None
    parts = []
    for seg in re.split(r"\.(?=\w+\(\w+\))", text):
        m = _HIER_SEG.match(seg)
        if m is None:
            return None
        if m.group(1) not in ("TOP", "SELF"):
            parts.append(m.group(1))
    return ".".join(parts)
