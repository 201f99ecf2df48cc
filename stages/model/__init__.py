"""What train, infer and serve share about a model: the zoo, safe checkpoints, `model.pt` + `model.json`,
the one eval transform and prediction."""
