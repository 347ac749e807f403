"""The `pairs` stage: sampling the starting policy and labelling best vs worst (stage.py), and the feedback rounds that
feed a round's policy back to sampling (feedback.py). Imports algorithms/ and everything below it."""
