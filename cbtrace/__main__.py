from cbtrace.cli.main import main

main()
