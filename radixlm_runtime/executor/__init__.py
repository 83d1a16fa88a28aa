"""The model executor: owns the weights, the KV tensors and every tensor of a step."""
