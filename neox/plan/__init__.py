"""Planning a run before any rank starts, without torch: which attention path and engine each
layer and run take, parameters and FLOPs, memory per GPU, the dry run's report and the checks of
files and data (preflight). deepy.py, tools/estimate.py and the ranks all ask these modules, so
the plan and the run cannot disagree."""
