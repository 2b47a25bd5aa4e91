"""FLy's decision: tensors in, tensors out (verification, sampling). No model code."""
