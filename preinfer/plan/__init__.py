"""What a run costs and whether it fits: the memory and cost models, the guards, the writer budget, the planner report."""
