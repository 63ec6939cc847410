"""Benchmarks of the seed paper's evaluation (issue 5): stronghold against DeepSpeed's offload modes.

`python -m examples.bench fig6a` (fig7a, fig8b, fig9, engine) runs or resumes one figure's sweep;
`python -m examples.bench report` turns results/bench/*.jsonl into tables, PNGs and claims.
README.md beside this file gives the commands, the JSON schema and the GPU-machine recipe.

Modules: point (what to run), flops (its size and FLOPs), model / systems (build it), run_one (the
child that measures one point; environment, its process and device), harness (the parent that runs
and classifies it), store (results on disk), sweep (budgeted runs with caching), search (Fig. 6a),
figures (one sweep per figure), queries / report / plots (tables, claims, PNGs).
"""
