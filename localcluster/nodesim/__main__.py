"""`python -m localcluster.nodesim`: one simulated node."""

from localcluster.nodesim.simulator import main

main()
