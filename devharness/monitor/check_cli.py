"""`devharness check`: its flags read, the check they ask for chosen (a layout against tp=1, kernel backends, batch
invariance, the prefix cache: check.py and check_prefix.py), the probe fitted to the model, the verdict printed."""
from __future__ import annotations

import functools
import json

from devharness.monitor.check import (default_tolerance, fit_to_model, print_table, run_batch_check, run_check,
                                      run_kernel_check)
from devharness.monitor.check_fit import DEFAULT_DECODE_STEPS, DEFAULT_PROMPT
from devharness.monitor.check_prefix import fit_prefix, run_prefix_check


def check_main(args) -> int:
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    model = kw.pop("model")
    against, batch = getattr(args, "against", None), getattr(args, "batch_invariance", False)
    prefix = getattr(args, "prefix_cache", False)
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    decode_steps = DEFAULT_DECODE_STEPS if args.decode_steps is None else args.decode_steps
    if sum((against is not None, batch, prefix)) > 1:
        raise ValueError("--against, --batch-invariance and --prefix-cache are three checks: give one")
    if decode_steps < 0:
        raise ValueError(f"--decode-steps {decode_steps}: give 0 (prefill only) or more decode steps")
    if prefix and args.tolerance is not None:
        raise ValueError(f"--tolerance {args.tolerance}: --prefix-cache compares bit for bit (it takes none)")
    if args.tolerance is not None and not (args.tolerance >= 0 if batch else args.tolerance > 0):
        raise ValueError(f"--tolerance {args.tolerance}: give a relative difference above 0, like 1e-4"
                         + (" (0: bit for bit)" if batch else ""))
    world = kw["tensor_parallel_size"] * kw["pipeline_parallel_size"]
    tol = args.tolerance if args.tolerance is not None else default_tolerance(kw["dtype"])
    if prefix:
        tol, run = 0.0, run_prefix_check
    elif batch:
        tol = args.tolerance if args.tolerance is not None else 0.0
        run = run_batch_check
    elif against is not None:
        kernels = kw.pop("kernels")
        if kernels == against:
            raise ValueError(f"--kernels {kernels} --against {against}: give two different backends")
        run = functools.partial(run_kernel_check, kernels=kernels, against=against)
    else:
        if world == 1 and kw["distributed_executor_backend"] in (None, "uni"):
            raise ValueError("check compares a layout with tp=1, pp=1: give --tp or --pp above 1 (or --executor "
                             "mp|ray), or --against BACKEND, or --batch-invariance")
        if kw["distributed_executor_backend"] is None:
            kw["distributed_executor_backend"] = "mp"
        run = run_check
    fit = fit_prefix if prefix else functools.partial(fit_to_model, batch=batch)
    probe, decode_steps, fitted = fit(model, prompt, decode_steps, args.prompt is not None,
                                      args.decode_steps is not None, **kw)
    report = run(model, probe, tol, decode_steps, **kw)
    report.fitted = fitted + report.fitted
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        if args.table:
            print_table(report)
        print(report.verdict())
    return 0 if report.ok else 1
