"""The training step: optimizer and scheduler wrappers and the gradient-accumulation state
(:mod:`.optim`), the step boundaries and their registered hooks (:mod:`.boundary`), mixed
precision (:mod:`.precision`), the machinery behind ``prepare``,
``backward`` and clipping (:mod:`.loop`), ``torch.compile`` (:mod:`.dynamo`), profiling
(:mod:`.profiling`), kwargs handlers (:mod:`.kwargs_handlers`) and the one way to reach the
module inside its wrappers (:mod:`.wrapping`)."""
