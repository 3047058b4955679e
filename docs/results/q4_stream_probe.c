/* The 4-bit products from memory on one core: the microbenchmark of docs/results "4-bit at the
   memory's speed on Zen 4". Not part of the package or its tests.

   A plain read (AVX-512 adds over 1 GiB), the decode step's MLP over 4-bit records in groups of
   32 slots (Qwen2.5 1.5B's shape: 28 layers x 280 groups of 1536 columns, synthetic bytes, from
   memory and from L2), and the dense 4-bit product of a 151936 x 1536 matrix (the output layer),
   one thread, best of 7. HUGE=1 puts the buffers in 2 MiB pages (madvise), as the package's
   weights are. Built against a checkout's kernel.c (x86 with AVX-512 VNNI):

     gcc -O3 -fopenmp -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -std=c11 -I. \
         -DNEWAPI -DKSRC='"selectinfer_ros/core/format/kernels/kernel.c"' \
         docs/results/q4_stream_probe.c -o /tmp/q4_stream_probe -lm
     /tmp/q4_stream_probe; HUGE=1 /tmp/q4_stream_probe

   (-DNEWAPI: the kernel with the fetch cursor, from commit 40174ec on; without it the older
   signatures.) */
#define _DEFAULT_SOURCE
#include KSRC
#include <stdio.h>
#include <sys/mman.h>
static double clk(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static uint8_t *rnd(size_t n){size_t m=(n+(2<<20)-1)/(2<<20)*(2<<20); uint8_t*p=aligned_alloc(2<<20,m); if(getenv("HUGE")) madvise(p,m,MADV_HUGEPAGE);
  uint64_t s=88172645463325252ull;for(size_t i=0;i<m;i+=8){s^=s<<13;s^=s>>7;s^=s<<17;memcpy(p+i,&s,8);}return p;}
static void fixg(uint8_t*b,int64_t H){ for(int j=0;j<2;j++){uint8_t*hh[2]={b+q4g_gate(H,j)+IL*H/2,b+q4g_up(H,j)+IL*H/2}; for(int u=0;u<2;u++)for(int64_t s=0;s<H/256;s++){uint8_t*q=hh[u]+s*IL_HEAD; for(int i=0;i<64;i+=2){q[i]=0;q[i+1]=0x20;}}}
  uint8_t*dh=b+q4g_dheads(H); for(int sl=0;sl<GS;sl++)for(int64_t s=0;s<H/256;s++){uint8_t*q=dh+sl*q4_head_bytes(H)+s*16;q[0]=0;q[1]=0x20;q[2]=0;q[3]=0x20;}}
static float acc[8192];
static void mlp(const uint8_t*blk,int64_t ng,int64_t gb,int64_t H,const int8_t*xq,const float*xd,const int32_t*xs){
  for(int64_t g=0;g<ng;g++){ const uint8_t*b=blk+g*gb; float gv[GS],uv[GS],a[GS];
#ifdef NEWAPI
    si_pf pf={b+gb, g+1<ng? b+2*gb : b+gb};
    q4g_gate_up(b,H,GS,xq,xd,xs,gv,uv,&pf); for(int i=0;i<GS;i++)a[i]=gv[i]*uv[i]; down_q4g(b,H,a,GS,acc,&pf);
#else
    q4g_gate_up(b,H,GS,xq,xd,xs,gv,uv); for(int i=0;i<GS;i++)a[i]=gv[i]*uv[i]; down_q4g(b,H,a,GS,acc);
#endif
  } }
int main(void){ int reps=7; const int64_t H=1536, F=8960, L=28;
  size_t nr=1ull<<30; uint8_t*rp=rnd(nr); double best=1e9;
  for(int r=0;r<5;r++){double t=clk(); __m512i a=_mm512_setzero_si512(),b=a,c=a,d=a;
    for(size_t i=0;i<nr;i+=256){a=_mm512_add_epi64(a,_mm512_load_si512(rp+i));b=_mm512_add_epi64(b,_mm512_load_si512(rp+i+64));c=_mm512_add_epi64(c,_mm512_load_si512(rp+i+128));d=_mm512_add_epi64(d,_mm512_load_si512(rp+i+192));}
    volatile long long z=_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a,b),_mm512_add_epi64(c,d)));(void)z;t=clk()-t;if(t<best)best=t;}
  double rd=nr/best/1e9; free(rp);
  float *x=malloc(H*4); for(int i=0;i<H;i++)x[i]=sinf(i*0.37f);
  int8_t*xq=aligned_alloc(64,H+64); float xd[H/32+2]; int32_t xs[H/32+2]; quantize_blocks(x,H,0,H/32,xq,xd,xs);
  int64_t gb=q4g_bytes(H), ng=(F+GS-1)/GS*L; uint8_t*blk=rnd(ng*gb); for(int64_t g=0;g<ng;g++)fixg(blk+g*gb,H);
  best=1e9; for(int r=0;r<reps;r++){double t=clk(); mlp(blk,ng,gb,H,xq,xd,xs); t=clk()-t; if(t<best)best=t;}
  double mem=ng*gb/best/1e9;
  best=1e9; for(int r=0;r<reps*40;r++){double t=clk(); mlp(blk,8,gb,H,xq,xd,xs); t=clk()-t; if(t<best)best=t;}
  double l2=8*gb/best/1e9;
  int64_t N=151936; size_t nb=N*H/2, hb=(N/16)*il_head_bytes(H); uint8_t*w=rnd(nb),*h=rnd(hb); float*yy=malloc(N*4);
  for(size_t g=0;g<N/16*(H/256);g++){uint8_t*q=h+g*IL_HEAD; for(int i=0;i<64;i+=2){q[i]=0;q[i+1]=0x20;}}
  best=1e9; for(int r=0;r<reps;r++){double t=clk(); si_linear_q4il(x,1,H,w,h,N,yy,1); t=clk()-t; if(t<best)best=t;}
  double ilm=(nb+hb)/best/1e9;
  printf("read %.1f GB/s | groups MLP: memory %.1f (%.2f of read), L2 %.1f GB/s | dense 4-bit: memory %.1f GB/s (%.2f of read)\n",rd,mem,mem/rd,l2,ilm,ilm/rd); return 0;}
