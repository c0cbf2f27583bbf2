"""Measurements of sage-lightning, run from the repository root as ``python -m benchmarks.<area>.<tool>``.

- ``kernels``: ``speed``, ``accuracy``, ``gpu_verify`` (the GPU record CI checks, ``gpu_record``), ``sm90_compile``
  and the Gluon compile checks (``gluon_dkdv_compile``, ``gluon_dq_compile``);
- ``training``: ``pretrain_compare`` (the comparison runner and the evidence matrix), ``results_doc``
  (docs/results.md) and ``readme_perf`` (the README's table);
- ``controller``: ``overhead``, ``thresholds``.

``result_file`` holds what every result file shares (header, commit, versions, paths, JSON). Answers of scripts
that ran once live in ``results/`` with the commit that holds the script.
"""
