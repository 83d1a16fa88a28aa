from radixlm.eval.cli import main

main()
