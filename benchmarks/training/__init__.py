"""The pretraining comparison, the evidence matrix, the attribution on real activations, and the pages made from
their results."""
