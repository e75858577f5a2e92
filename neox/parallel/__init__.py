"""Tensor, pipeline and data parallelism applied to the plain GPTNeoX from outside.

`topology` is the layout (tp x pp x dp) and its process groups; `tensor` swaps the model's
linears for column/row-parallel ones; `pipeline` cuts it into DeepSpeed pipeline stages;
`build.parallelize` does all of it for a run. Import from the module that holds a name: this
package imports nothing, so a module below `build` (layers, topology) never pulls in the rest.
"""
