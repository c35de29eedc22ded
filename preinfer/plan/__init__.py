"""What a run costs and whether it fits: the memory and cost models, the guards, the writer budget
(the report of `preinfer plan`, which reads the whole config, is preinfer/run/plan_report.py)."""
