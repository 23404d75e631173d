"""The paper's experiments (its Tables 1-3 and the rank/risk frontier), apart from the library they exercise.

:mod:`rstar.paper.experiments` reruns them through the public estimators and students;
``rstar experiments`` is its command line.
"""
