"""Training proposers for a served model from the model's own outputs (self-distillation)."""
