/* Floods a snapkvd client endpoint with malformed requests (answered by the socket thread) for SECS seconds,
 * from NDEALERS DEALERs, reading and discarding the replies. Usage: flood ENDPOINT SECS NDEALERS (docs/perf/flood-roundtrip.sh). */
#include <zmq.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
int main(int argc,char**argv){
  const char*ep=argv[1]; double secs=atof(argv[2]); int nd=atoi(argv[3]);
  void*c=zmq_ctx_new(); void*d[16]; char buf[4096];
  for(int i=0;i<nd;i++){d[i]=zmq_socket(c,ZMQ_DEALER);int hwm=100000;zmq_setsockopt(d[i],ZMQ_SNDHWM,&hwm,4);zmq_connect(d[i],ep);}
  double t0=now(); long sent=0,got=0;
  while(now()-t0<secs){
    for(int i=0;i<nd;i++){ for(int k=0;k<50;k++) if(zmq_send(d[i],"\xff\xff\xff",3,ZMQ_DONTWAIT)==3) sent++;
      while(zmq_recv(d[i],buf,sizeof buf,ZMQ_DONTWAIT)>=0) got++; }
  }
  fprintf(stderr,"flood: sent %ld, replies %ld\n",sent,got);
  int l=0; for(int i=0;i<nd;i++){zmq_setsockopt(d[i],ZMQ_LINGER,&l,4);zmq_close(d[i]);} zmq_ctx_term(c); return 0;}
