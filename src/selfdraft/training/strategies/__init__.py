"""Per-method training strategies (loss and data-dependent preparation), one module per method.
Each is named by its method's entry in drafters.base.TRAINED and imported by training.strategy.STRATEGIES."""
