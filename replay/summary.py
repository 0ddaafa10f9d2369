"""The end-of-replay summary table (delegates to the 'summary' reporter when installed)."""
from __future__ import annotations


def summary_text(df, top: int = 15) -> str:
    from cbtrace import registry

    rep = registry.reporters().get("summary")
    if rep is not None and hasattr(rep, "render"):
        return rep.render(df, top=top)
    cols = ["fqn", "module_type", "status", "timer", "isolated_ms", "mfu", "mbu", "bound"]
    d = df[[c for c in cols if c in df]].sort_values("isolated_ms", ascending=False).head(top)
    return d.to_string(index=False)
