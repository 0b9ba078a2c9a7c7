"""The engine's durable state: the one layer that reads and writes `engine.*` (DESIGN §7).

Each statement is written out whole and named; each transition is a function whose guard sits in
its WHERE clause and whose return says whether it landed.
"""
