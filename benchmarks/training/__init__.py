"""The pretraining comparison, the evidence matrix, and the pages made from their results."""
