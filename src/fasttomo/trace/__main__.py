from fasttomo.trace.command import main

main()
