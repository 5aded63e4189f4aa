"""prep: an ImageNet-layout image tree -> shuffled uint8 hickle batches, mean image and labels."""

__all__: list[str] = []
