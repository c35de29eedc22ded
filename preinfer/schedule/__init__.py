"""Which block reads which rows when: the rotation, a visit's rows, one VisitPlan per (round, block), the cache identity."""
