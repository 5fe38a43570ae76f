"""``python -m cublas_guard_ext run``: an unmodified script under the guard, in every process of
the run, with one incident report per process when it dies. docs/run.md has the user's view.

* ``options``   the command line and the one variable (``CUBLAS_GUARD_RUN``) that carries it
* ``cli``       checks the command line, then becomes ``python SCRIPT ARGS`` (exec)
* ``_site``     the ``sitecustomize`` bootstrap: installs ``runtime`` when a process imports torch
* ``runtime``   the guard in one process: ``linear``, ``steps``, ``watching``, the excepthook
* ``ranks``     per-rank names, and one rank's failure stopping the others within seconds
* ``incident``  the facts of a failure; ``report_html`` renders them
"""
