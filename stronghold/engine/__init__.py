"""The DeepSpeedEngine subclass and the runtime it drives: the step's order of work, the optimizer facade, the report."""
