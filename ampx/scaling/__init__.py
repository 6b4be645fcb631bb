"""Loss scaling and the scaled-backward protocol: the scaler, one stage machine per optimizer
(`protocol`), a `scale_loss` pass, unscaling, stepping, fp32 masters, checkpoints, and the
journal every transition commits through."""
